"""Emulated WAN hosts for chaos tests: one network namespace per island, each joined to the root namespace by
its own point-to-point link with delay, loss and a rate limit on both directions (so 40 ms each way is an 80 ms
RTT).

Layout, for a WAN on network 10.X (X picked free among 200-249 at start):
  * the coordinator's address 10.X.255.1/32 sits on the root namespace's `lo` (label `lo:dpc<pid>`), so one URL
    serves every island and the coordinator binds no other interface;
  * host i: namespace `dpc<pid>-<i>`, link `dpc<pid>h<i>` (root side, 10.X.0.4i+1) <-> `dpc<pid>n<i>` (inside,
    10.X.0.4i+2, default route over the link).
Links are veth pairs with `tc qdisc ... netem delay D loss L rate R` on both ends when the kernel has netem;
otherwise (CONFIG_NET_SCH_NETEM unset) TUN pairs carried by `tests/chaos/wire.py`, a userspace equivalent. The
`backend` attribute says which one a WAN got.

Everything is named after the creating process's pid (so one WAN per process at a time; concurrent test runs in
other processes get their own names and network): `EmulatedWan` first removes what dead processes of the family
left (a test killed before its teardown), never another live run's; its teardown (a context manager,
also run when building fails half-way) kills whatever still runs inside its namespaces, deletes them, their
links and the `lo` address, and stops the wire process. Needs root (CAP_NET_ADMIN) and `ip`/`tc` (iproute2);
`unavailable_reason()` says why not, for a skip.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import re
import select
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Literal

log = logging.getLogger(__name__)

FAMILY = "dpc"
_NAME = re.compile(rf"^{FAMILY}(\d+)[-hn]")
WIRE = Path(__file__).with_name("wire.py")
Backend = Literal["netem", "userspace"]


@dataclass(frozen=True, slots=True)
class Impairment:
    """What each direction of every link does to packets (netem's terms)."""

    delay_ms: float = 40.0
    """One-way delay; the RTT is twice this."""
    loss: float = 0.01
    """Probability that a packet is dropped."""
    rate_mbit: float = 50.0

    def netem_args(self) -> list[str]:
        return ["delay", f"{self.delay_ms}ms", "loss", f"{self.loss * 100}%", "rate", f"{self.rate_mbit}mbit"]

    def __str__(self) -> str:
        return f"{2 * self.delay_ms:g} ms RTT, {self.loss:.1%} loss, {self.rate_mbit:g} Mbit/s"


@dataclass(frozen=True, slots=True)
class Host:
    """An emulated machine: commands run in its namespace reach the coordinator through its link only."""

    namespace: str
    address: str
    """Its address (inside the namespace)."""
    link: str
    """The root-side device of its link."""
    peer: str
    """The device at the namespace's end of the link."""

    def command(self, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespace, *argv]


@dataclass(frozen=True, slots=True)
class LinkStats:
    packets: int
    """Packets that crossed the links, both directions."""
    lost: int
    """Packets dropped by the emulated loss."""


def tcp_rtt_ms(host: Host, address: str, port: int, *, samples: int = 7) -> float:
    """Median time of a TCP connect from `host` to address:port: one round trip (SYN, SYN-ACK) over its link."""
    script = (
        "import socket, statistics, sys, time\n"
        "times = []\n"
        f"for _ in range({samples}):\n"
        "    t = time.perf_counter()\n"
        f"    socket.create_connection(({address!r}, {port}), timeout=10).close()\n"
        "    times.append(time.perf_counter() - t)\n"
        "sys.stdout.write(str(statistics.median(times) * 1000))\n"
    )
    out = subprocess.run(host.command([sys.executable, "-c", script]), capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise RuntimeError(f"RTT probe from {host.namespace} failed: {out.stderr.strip()}")
    return float(out.stdout)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip() or proc.returncode}")
    return proc


def _tc(*args: str, namespace: str | None = None) -> subprocess.CompletedProcess[str]:
    ns = ["-n", namespace] if namespace else []
    proc = subprocess.run(["tc", *ns, *args], capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise RuntimeError(f"tc {' '.join(args)}: {proc.stderr.strip() or proc.returncode}")
    return proc


def unavailable_reason() -> str | None:
    """None when this process can build an emulated WAN, else why not (for `pytest.skip`)."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces are Linux only (platform {sys.platform})"
    if os.geteuid() != 0:
        return "needs root: network namespaces, links and qdiscs need CAP_NET_ADMIN"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"iproute2 missing: {', '.join(missing)} not on PATH"
    probe = f"{FAMILY}{os.getpid()}-probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace (`ip netns add` said: {made.stderr.strip()})"
    _ip("netns", "del", probe, check=False)
    if not netem_available() and not os.access("/dev/net/tun", os.R_OK | os.W_OK):
        return "the kernel has no netem qdisc and /dev/net/tun is not usable for the userspace link"
    return None


@functools.cache
def netem_available() -> bool:
    """Whether `tc qdisc add ... netem` works here (probed once on a throwaway veth pair)."""
    a, b = f"{FAMILY}{os.getpid()}h999", f"{FAMILY}{os.getpid()}n999"
    if _ip("link", "add", a, "type", "veth", "peer", "name", b, check=False).returncode != 0:
        return False
    try:
        _tc("qdisc", "add", "dev", a, "root", "netem", "delay", "1ms")
        return True
    except RuntimeError:
        return False
    finally:
        _ip("link", "del", a, check=False)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_leftovers() -> list[str]:
    """Remove namespaces, links and `lo` addresses of the family whose creating process is gone; returns them."""
    removed: list[str] = []
    for line in _ip("netns", "list").stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        m = _NAME.match(name)
        if m and not _alive(int(m.group(1))):
            _kill_inside(name)
            _ip("netns", "del", name, check=False)
            removed.append(name)
    for line in _ip("-o", "link", "show").stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        m = _NAME.match(name)
        if m and not _alive(int(m.group(1))):
            _ip("link", "del", name, check=False)
            removed.append(name)
    for line in _ip("-4", "-o", "addr", "show", "dev", "lo").stdout.splitlines():
        m = re.search(rf"inet (\S+) .*\blo:{FAMILY}(\d+)\b", line)
        if m and not _alive(int(m.group(2))):
            _ip("addr", "del", m.group(1), "dev", "lo", check=False)
            removed.append(m.group(1))
    return removed


def _kill_inside(namespace: str) -> list[int]:
    """SIGKILL the processes still running in one of our namespaces (they would keep it alive); returns them."""
    pids = [int(p) for p in _ip("netns", "pids", namespace, check=False).stdout.split()]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return pids


def _claim_network(label: str) -> str:
    """A free 10.X network (X in 200-249), claimed by putting its coordinator address 10.X.255.1 on `lo`: two runs
    starting at once cannot both add it, so the second moves on to the next X."""
    used = set(re.findall(r"inet 10\.(\d+)\.", _ip("-4", "-o", "addr", "show").stdout))
    for octet in range(200, 250):
        if (
            str(octet) not in used
            and _ip("addr", "add", f"10.{octet}.255.1/32", "dev", "lo", "label", label, check=False).returncode == 0
        ):
            return f"10.{octet}"
    raise RuntimeError("no free 10.X network (X in 200-249) for an emulated WAN")


@dataclass
class EmulatedWan:
    """`count` emulated hosts; use as a context manager (teardown always runs)."""

    count: int
    workdir: Path
    """Where the wire process writes its log and counters."""
    impairment: Impairment = field(default_factory=Impairment)
    backend_choice: Backend | Literal["auto"] = "auto"
    seed: int = 0
    """Seeds the userspace link's loss draws (netem draws its own)."""
    hosts: list[Host] = field(default_factory=list, init=False)
    backend: Backend = field(default="netem", init=False)
    server_address: str = field(default="", init=False)
    _namespaces: list[str] = field(default_factory=list, init=False)
    _links: list[str] = field(default_factory=list, init=False)
    _wire: subprocess.Popen[bytes] | None = field(default=None, init=False)
    _stats_file: Path | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if not 1 <= self.count <= 60:
            raise ValueError(f"count must be within 1-60, got {self.count}")

    def __enter__(self) -> EmulatedWan:
        removed = clean_leftovers()
        if removed:
            log.warning("removed leftovers of dead chaos runs: %s", ", ".join(removed))
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    # -- building ------------------------------------------------------------------------------------------

    def _build(self) -> None:
        if self.backend_choice == "auto":
            self.backend = "netem" if netem_available() else "userspace"
        else:
            self.backend = self.backend_choice
        pid = os.getpid()
        net = _claim_network(f"lo:{FAMILY}{pid}")
        self.server_address = f"{net}.255.1"
        names = [(f"{FAMILY}{pid}-{i}", f"{FAMILY}{pid}h{i}", f"{FAMILY}{pid}n{i}") for i in range(self.count)]
        for ns, _, _ in names:
            _ip("netns", "add", ns)
            self._namespaces.append(ns)
        if self.backend == "userspace":
            self._start_wire([(h, n) for _, h, n in names])
        for i, (ns, h, n) in enumerate(names):
            outer, inner = f"{net}.0.{4 * i + 1}", f"{net}.0.{4 * i + 2}"
            if self.backend == "netem":
                _ip("link", "add", h, "type", "veth", "peer", "name", n, "netns", ns)
                self._links.append(h)
                _ip("addr", "add", f"{outer}/30", "dev", h)
                _ip("-n", ns, "addr", "add", f"{inner}/30", "dev", n)
                _tc("qdisc", "add", "dev", h, "root", "netem", *self.impairment.netem_args())
                _tc("qdisc", "add", "dev", n, "root", "netem", *self.impairment.netem_args(), namespace=ns)
            else:
                self._links.append(h)
                _ip("link", "set", n, "netns", ns)
                _ip("addr", "add", outer, "peer", inner, "dev", h)
                _ip("-n", ns, "addr", "add", inner, "peer", outer, "dev", n)
            _ip("link", "set", h, "up")
            _ip("-n", ns, "link", "set", n, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            # a veth is a broadcast link (the gateway must be named); a TUN device is point-to-point
            via = ["via", outer] if self.backend == "netem" else ["dev", n]
            _ip("-n", ns, "route", "add", "default", *via)
            self.hosts.append(Host(namespace=ns, address=inner, link=h, peer=n))

    def _start_wire(self, links: list[tuple[str, str]]) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._stats_file = self.workdir / "wire-stats.json"
        imp = self.impairment
        argv = [sys.executable, str(WIRE), "--stats", str(self._stats_file), "--seed", str(self.seed)]
        argv += ["--delay-ms", str(imp.delay_ms), "--loss", str(imp.loss), "--rate-mbit", str(imp.rate_mbit)]
        for h, n in links:
            argv += ["--link", f"{h}:{n}"]
        with (self.workdir / "wire.log").open("ab") as err:
            self._wire = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err)
        assert self._wire.stdout is not None
        ready, _, _ = select.select([self._wire.stdout], [], [], 30)
        line = self._wire.stdout.readline() if ready else b""
        if line.strip() != b"ready":
            raise RuntimeError(f"the userspace link did not start: {(self.workdir / 'wire.log').read_text()[-2000:]}")

    # -- reading -------------------------------------------------------------------------------------------

    def stats(self) -> LinkStats:
        """Packets carried and lost so far over all links (netem's qdisc counters, or the wire's)."""
        if self.backend == "userspace":
            assert self._stats_file is not None
            counters = json.loads(self._stats_file.read_text()).values() if self._stats_file.exists() else []
            return LinkStats(packets=sum(c["packets"] for c in counters), lost=sum(c["lost"] for c in counters))
        packets = lost = 0
        for host in self.hosts:
            for ns, dev in ((None, host.link), (host.namespace, host.peer)):
                out = _tc("-s", "qdisc", "show", "dev", dev, namespace=ns).stdout
                m = re.search(r"Sent \d+ bytes (\d+) pkt \(dropped (\d+)", out)
                if m:
                    packets, lost = packets + int(m.group(1)), lost + int(m.group(2))
        return LinkStats(packets=packets, lost=lost)

    # -- teardown ------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Remove everything this WAN made; never raises (a failure to remove is logged)."""
        for ns in self._namespaces:
            killed = _kill_inside(ns)
            if killed:
                log.warning("killed processes left in %s: %s", ns, killed)
        if self._wire is not None:
            if self._wire.stdin is not None:
                self._wire.stdin.close()  # EOF: the wire exits and its TUN devices go with it
            try:
                self._wire.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._wire.kill()
                self._wire.wait()
            if self._wire.stdout is not None:
                self._wire.stdout.close()
            self._wire = None
        for ns in self._namespaces:
            if _ip("netns", "del", ns, check=False).returncode != 0:
                log.warning("could not delete namespace %s", ns)
        self._namespaces.clear()
        for link in self._links:  # deleting a namespace takes its veth peer down asynchronously; be sure
            _ip("link", "del", link, check=False)
        self._links.clear()
        if self.server_address:
            _ip("addr", "del", f"{self.server_address}/32", "dev", "lo", check=False)
            self.server_address = ""
        self.hosts.clear()
