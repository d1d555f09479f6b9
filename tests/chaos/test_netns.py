"""The emulated WAN itself (tests/chaos/netns.py): the RTT, rate and loss it promises, and a teardown that leaves
nothing behind, also after the process that built it was killed."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.chaos.netns import FAMILY, EmulatedWan, Impairment, clean_leftovers, tcp_rtt_ms, unavailable_reason

IMPAIRMENT = Impairment(delay_ms=40, loss=0.01, rate_mbit=50)
UPLOAD = 4_000_000


@pytest.fixture(autouse=True)
def _needs_namespaces() -> None:
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"cannot emulate a WAN here: {reason}")


def ours(pid: int) -> list[str]:
    """Namespaces, links and `lo` addresses named after `pid`."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    out += subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    out += subprocess.run(["ip", "-o", "addr", "show", "dev", "lo"], capture_output=True, text=True).stdout
    return [word for word in out.split() if word.startswith((f"{FAMILY}{pid}", f"lo:{FAMILY}{pid}"))]


@pytest.fixture
def sink() -> Iterator[socket.socket]:
    """A TCP listener that reads everything and answers `ok` once a sender closes its side."""
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("0.0.0.0", 0))
    server.listen(8)

    def drain(conn: socket.socket) -> None:
        with conn:
            while conn.recv(1 << 16):
                pass
            conn.sendall(b"ok")

    def accept() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=drain, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield server
    finally:
        server.close()


def test_wan_has_the_promised_rtt_rate_and_loss_and_leaves_nothing(tmp_path: Path, sink: socket.socket) -> None:
    port = sink.getsockname()[1]
    with EmulatedWan(2, workdir=tmp_path, impairment=IMPAIRMENT, seed=1) as wan:
        assert len(ours(os.getpid())) >= 5  # 2 namespaces, 2 root-side links, the coordinator's address
        rtts = [tcp_rtt_ms(host, wan.server_address, port) for host in wan.hosts]
        send = (
            "import socket, sys, time\n"
            f"s = socket.create_connection(({wan.server_address!r}, {port}))\n"
            "t = time.perf_counter()\n"
            f"s.sendall(bytes({UPLOAD}))\n"
            "s.shutdown(socket.SHUT_WR)\n"
            "assert s.recv(2) == b'ok'\n"
            "sys.stdout.write(str(time.perf_counter() - t))\n"
        )
        took = float(
            subprocess.run(
                wan.hosts[0].command([sys.executable, "-c", send]),
                capture_output=True,
                text=True,
                check=True,
                timeout=120,
            ).stdout
        )
        time.sleep(1.2)  # the userspace link writes its counters about once a second
        link = wan.stats()
    assert all(2 * IMPAIRMENT.delay_ms * 0.95 <= rtt <= 2 * IMPAIRMENT.delay_ms + 40 for rtt in rtts), rtts
    assert took >= UPLOAD * 8 / (IMPAIRMENT.rate_mbit * 1e6), took  # never faster than the link's rate
    assert link.packets > UPLOAD / 1500 and 0 < link.lost < link.packets * 0.05, link
    assert ours(os.getpid()) == []


def test_leftovers_of_a_killed_run_are_removed(tmp_path: Path) -> None:
    build_and_die = (
        "import os, signal, sys\n"
        "from pathlib import Path\n"
        "from tests.chaos.netns import EmulatedWan\n"
        f"wan = EmulatedWan(2, workdir=Path({str(tmp_path)!r})).__enter__()\n"
        "sys.stdout.write(str(os.getpid()))\n"
        "sys.stdout.flush()\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    proc = subprocess.run([sys.executable, "-c", build_and_die], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -9, proc.stderr
    dead = int(proc.stdout)
    assert len(ours(dead)) >= 3  # its namespaces and address outlived it
    removed = clean_leftovers()
    assert ours(dead) == [] and len(removed) >= 3, removed
