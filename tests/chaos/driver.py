"""One chaos run: a real coordinator in the root namespace, `dipaco island join` processes on emulated WAN hosts
(tests/chaos/netns.py), and faults fired on a seeded schedule, keyed by (round, path):

  * the coordinator is started with `DIPACO_FAULT_PAUSE_AT=upload.before_commit` (coordinator/faults.py), so the
    run's first upload pauses it with the upload's blobs written and its transaction open; it is SIGKILLed there
    and restarted on the same database and data directory;
  * `IslandKill(round, path, after_s)`: `after_s` seconds after round `round` opened, the island holding path
    `path` (training it, or idle after uploading it) is SIGKILLed, and a replacement starts on the same host.

`ChaosRun.run` returns what fired and when, and how long each fault took to heal: from a coordinator kill to the
next applied round, from an island kill to the next lease of its path. Used by tests/chaos/test_wan_chaos.py
and bench/bench_chaos.py; with no hosts and an empty schedule it is the calm run (loopback, no faults).
"""

from __future__ import annotations

import logging
import random
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import httpx

from coordinator.client import CoordinatorClient, CoordinatorUnavailable, RetryPolicy
from coordinator.states import LeaseStatus, RunStatus
from tests.chaos.netns import Host
from tests.conftest import ADMIN
from tests.integration.conftest import Cluster, create_run

log = logging.getLogger(__name__)

FAULT_POINT = "upload.before_commit"
COORDINATOR_ENV = {
    # Short liveness so a killed island's path comes back within seconds: islands heartbeat every second
    # against the runs' 8 s lease TTL (8 heartbeats of slack on a lossy link; a coordinator restart, ~3-5 s
    # here, stays under it), a live island's path is held 3 s for it after a round opens.
    "DIPACO_HEARTBEAT_INTERVAL_S": "1",
    "DIPACO_PATH_RESERVATION_S": "3",
    "DIPACO_SWEEP_INTERVAL_S": "0.5",
}
ISLAND_FLAGS = (
    "--no-probe",
    "--exit-when-idle",  # leave once the run is finished
    "--give-up-after",
    "120",  # a coordinator restart is a few seconds of refused connections
    "--max-backoff",
    "2",  # ... and islands come back within 2 s of it, not the default 30
)
POLL_S = 0.1
POLL_TIMEOUT = httpx.Timeout(3.0)
"""The driver's own reads: short, never retried (the loop polls again). A coordinator paused at the fault point
answers nothing at all (the pause blocks its event loop), and the driver must get back to the marker check."""


@dataclass(frozen=True, slots=True)
class IslandKill:
    round: int
    path: int
    """`after_s` seconds after round `round` opened (the run may be further by then: rounds over an 80 ms RTT take
    ~1.5 s here), the island holding path `path` is killed, training it or idle after uploading it."""
    after_s: float


@dataclass(frozen=True, slots=True)
class Schedule:
    island_kills: tuple[IslandKill, ...] = ()
    coordinator_kill: bool = False
    """SIGKILL the coordinator paused in the run's first upload (at `FAULT_POINT`), then restart it."""

    @classmethod
    def seeded(
        cls,
        seed: int,
        *,
        kill_rounds: range,
        paths: int,
        island_kills: int,
        max_after_s: float,
        coordinator_kill: bool = True,
    ) -> Schedule:
        """`island_kills` kills in distinct rounds drawn from `kill_rounds`, each at a random path and moment.
        Round 0 is a poor choice: every path starts from a fresh AdamW there anyway, so a kill costs no state."""
        if not 0 <= island_kills <= len(kill_rounds):
            raise ValueError(f"{island_kills} island kills need as many distinct rounds in {kill_rounds}")
        rng = random.Random(seed)
        kills = [
            IslandKill(round=r, path=rng.randrange(paths), after_s=round(rng.uniform(0, max_after_s), 2))
            for r in sorted(rng.sample(kill_rounds, island_kills))
        ]
        return cls(island_kills=tuple(kills), coordinator_kill=coordinator_kill)

    def __str__(self) -> str:
        parts = [f"coordinator SIGKILL at {FAULT_POINT} of the first upload"] if self.coordinator_kill else []
        parts += [f"island SIGKILL round {k.round} path {k.path} +{k.after_s:.2f}s" for k in self.island_kills]
        return "; ".join(parts) or "no faults"


@dataclass(slots=True)
class Fault:
    """A fault that fired."""

    kind: Literal["coordinator", "island"]
    at: datetime
    round: int
    """The run's round when it fired."""
    path: int | None = None
    island: str | None = None
    island_id: int | None = None
    state: str = ""
    """What the victim was doing: paused in an upload, holding its path's lease (training, or its upload in flight),
    or idle after its upload was accepted."""
    recovery_s: float | None = None
    """Coordinator: until the next applied round. Island: until its path was leased again."""


@dataclass(slots=True)
class Outcome:
    run_id: int
    wall_s: float
    faults: list[Fault] = field(default_factory=list)
    exit_codes: dict[str, int | None] = field(default_factory=dict)
    """Island name -> exit code (-9: killed)."""


def _utc(ts: datetime) -> datetime:
    return ts if ts.tzinfo is not None else ts.replace(tzinfo=UTC)


class ChaosRun:
    """Islands (one per path) on `hosts` (round robin; None: loopback) against `cluster`'s coordinator."""

    def __init__(
        self, cluster: Cluster, *, hosts: Sequence[Host] | None, schedule: Schedule, timeout_s: float = 300
    ) -> None:
        self.cluster = cluster
        self.hosts = list(hosts) if hosts else []
        self.schedule = schedule
        self.timeout_s = timeout_s
        self.procs: dict[str, tuple[subprocess.Popen[bytes], Host | None]] = {}

    def start_island(self, name: str, host: Host | None) -> None:
        wrap = host.command([]) if host is not None else []
        self.procs[name] = (self.cluster.start_island(name, *ISLAND_FLAGS, wrap=wrap), host)

    def run(self, spec: dict[str, Any], *, num_tokens: int) -> Outcome:
        t0 = time.monotonic()
        fault_env = {"DIPACO_FAULT_PAUSE_AT": FAULT_POINT} if self.schedule.coordinator_kill else {}
        self.cluster.start_coordinator(env={**COORDINATOR_ENV, **fault_env})
        with self.cluster.admin() as http:
            run_id = create_run(http, spec, num_tokens=num_tokens)
        with CoordinatorClient(self.cluster.url, ADMIN, timeout=POLL_TIMEOUT, retry=RetryPolicy.once()) as admin:
            paths = admin.run(run_id).num_paths
            for k in range(paths):
                self.start_island(f"island-{k}", self.hosts[k % len(self.hosts)] if self.hosts else None)
            outcome = Outcome(run_id=run_id, wall_s=0.0)
            self._drive(admin, run_id, outcome)
            self._recovery_times(admin, run_id, outcome)
        for name, (proc, _) in self.procs.items():
            try:
                outcome.exit_codes[name] = proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                outcome.exit_codes[name] = None
        outcome.wall_s = time.monotonic() - t0
        return outcome

    def _drive(self, admin: CoordinatorClient, run_id: int, outcome: Outcome) -> None:
        pending = sorted(self.schedule.island_kills, key=lambda k: (k.round, k.after_s))
        coordinator_kill = self.schedule.coordinator_kill
        marker = self.cluster.data_dir / f"fault-{FAULT_POINT}.reached"
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            time.sleep(POLL_S)
            if coordinator_kill and marker.exists():
                outcome.faults.append(self._kill_coordinator(marker))
                coordinator_kill = False
            try:
                run = admin.run(run_id)
                if run.status == RunStatus.FINISHED:
                    if coordinator_kill or pending:
                        raise AssertionError(
                            f"run finished before every fault fired: {self.schedule}; fired: {outcome.faults}"
                        )
                    return
                if pending and run.current_round >= pending[0].round:
                    opened = next(r.opened_at for r in admin.rounds(run_id) if r.number == pending[0].round)
                    if (datetime.now(UTC) - _utc(opened)).total_seconds() >= pending[0].after_s:
                        fault = self._kill_island(admin, run_id, run.current_round, pending[0])
                        if fault is not None:
                            outcome.faults.append(fault)
                            pending.pop(0)
            except CoordinatorUnavailable:
                continue  # paused at the fault point (or restarting): check the marker again
        raise TimeoutError(f"run {run_id} not finished after {self.timeout_s} s\n{self.cluster.log('coordinator')}")

    def _kill_coordinator(self, marker: Path) -> Fault:
        proc = self.cluster.coordinator
        assert proc is not None
        at = datetime.now(UTC)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=10) == -signal.SIGKILL  # the fault fired: killed inside the upload's transaction
        marker.unlink()
        self.cluster.start_coordinator(env=COORDINATOR_ENV)
        log.info("coordinator SIGKILLed at %s and restarted", FAULT_POINT)
        # the first upload of the run pauses it, so round 0 cannot have been applied yet
        return Fault(kind="coordinator", at=at, round=0, state=f"paused at {FAULT_POINT}")

    def _kill_island(self, admin: CoordinatorClient, run_id: int, current: int, kill: IslandKill) -> Fault | None:
        """SIGKILL the island holding `kill.path` (an active lease of it, else the last to lease it) and start a
        replacement on its host; None when that island is already gone (try again on the next poll)."""
        leases = [lease for lease in admin.leases(run_id=run_id) if lease.path_index == kill.path]  # newest first
        if not leases:
            log.info("kill %s: path %d has no lease yet", kill, kill.path)
            return None
        # active: training it, or its upload in flight (the run may already be a round further than `current`)
        holding = [lease for lease in leases if lease.status == LeaseStatus.ACTIVE]
        victim_id = (holding or leases)[0].island_id
        name = next(i.name for i in admin.islands() if i.id == victim_id)
        proc, host = self.procs[name]
        if proc.poll() is not None:
            log.info("kill %s: %s, the last to hold the path, is already gone; waiting for its successor", kill, name)
            return None
        at = datetime.now(UTC)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        replacement = f"island-{kill.path}-r{sum(1 for n in self.procs if n.startswith(f'island-{kill.path}-r'))}"
        self.start_island(replacement, host)
        state = "lease active" if holding else "idle, path uploaded"
        log.info("SIGKILLed %s (%s path %d, round %d); started %s", name, state, kill.path, current, replacement)
        return Fault(kind="island", at=at, round=current, path=kill.path, island=name, island_id=victim_id, state=state)

    def _recovery_times(self, admin: CoordinatorClient, run_id: int, outcome: Outcome) -> None:
        applied = sorted(_utc(r.applied_at) for r in admin.rounds(run_id) if r.applied_at is not None)
        leases = admin.leases(run_id=run_id)
        for fault in outcome.faults:
            if fault.kind == "coordinator":
                after = [t for t in applied if t > fault.at]
            else:
                # the path handed to another island (an offer to the dead one, made before its heartbeats stopped
                # counting, is not a recovery)
                issued = (
                    _utc(lease.issued_at)
                    for lease in leases
                    if lease.path_index == fault.path and lease.island_id != fault.island_id
                )
                after = sorted(t for t in issued if t > fault.at)
            fault.recovery_s = (after[0] - fault.at).total_seconds() if after else None
