"""Island faults against a real coordinator process and island processes on loopback (SQLite and PostgreSQL).

Each test asserts the invariant (the run finishes, every module is at version == rounds, who trained what) and
that the fault fired (return codes, lease statuses, retry lines in the island's log). Leases are held in place
with the island's fault injection (`DIPACO_ISLAND_FAULT_STALL=ROUND:STEP:SECONDS`, see island/faults.py), so
no test depends on training being slow enough to be caught in the act.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import pytest
from sqlalchemy import Engine, select

from coordinator.db import make_engine
from coordinator.models import Island, Lease
from tests.integration.conftest import (
    ISLAND_DB_PARAMS,
    TORCHRUN_2,
    Cluster,
    create_run,
    island_database_url,
    wait_finished,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


@pytest.fixture(params=ISLAND_DB_PARAMS)
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """SQLite only unless DIPACO_FULL_MATRIX=1 (see tests/integration/conftest.py)."""
    return island_database_url(request, tmp_path)


ONE_PATH = {
    "model": {"flavour": "debug", "d_model": 32, "seq_len": 16, "n_heads": 2},
    "layout": "embed:shared, b0-1:shared, head:shared",
    "inner": {"batch_size": 2, "warmup_steps": 0, "lr": 0.01},
    "inner_steps": 3,
    "num_rounds": 2,
}
FAST_RETRY = ("--max-backoff", "0.5", "--no-probe")


@dataclass
class LeaseRow:
    id: int
    island: str
    round: int
    path_id: int
    status: str
    issued_at: datetime


@pytest.fixture
def engine(cluster: Cluster) -> Iterator[Engine]:
    e = make_engine(cluster.database_url)
    try:
        yield e
    finally:
        e.dispose()


@pytest.fixture(autouse=True)
def fast_heartbeats(monkeypatch: pytest.MonkeyPatch) -> None:
    # The coordinator reads DIPACO_HEARTBEAT_INTERVAL_S; islands adopt the interval it hands out on join.
    monkeypatch.setenv("DIPACO_HEARTBEAT_INTERVAL_S", "0.5")


def leases(engine: Engine) -> list[LeaseRow]:
    with engine.connect() as conn:
        rows = conn.execute(
            select(Lease.id, Island.name, Lease.round, Lease.path_id, Lease.status, Lease.issued_at)
            .join(Island, Island.id == Lease.island_id)
            .order_by(Lease.id)
        ).all()
    return [LeaseRow(*row) for row in rows]


def wait_for(
    what: str, check: Callable[[], bool], *, timeout_s: float, cluster: Cluster, logs: tuple[str, ...]
) -> float:
    """Poll until `check()`; returns the seconds it took."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if check():
            return time.monotonic() - t0
        time.sleep(0.1)
    dump = "\n".join(f"--- {name}\n{cluster.log(name)}" for name in logs)
    raise TimeoutError(f"{what}: not after {timeout_s} s\n{dump}")


def start_stalled(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch, name: str, stall: str, *extra: str, wrap: Sequence[str] = ()
) -> subprocess.Popen[bytes]:
    """An island whose lease of round ROUND stalls before step STEP (heartbeats go on)."""
    monkeypatch.setenv("DIPACO_ISLAND_FAULT_STALL", stall)
    try:
        return cluster.start_island(name, *FAST_RETRY, *extra, wrap=wrap)
    finally:
        monkeypatch.delenv("DIPACO_ISLAND_FAULT_STALL")


def stalling(cluster: Cluster, name: str) -> Callable[[], bool]:
    return lambda: "fault injection: stalling" in cluster.log(name)


def module_versions(cluster: Cluster, run_id: int) -> list[int]:
    with cluster.admin() as client:
        return [m["version"] for m in client.get("/v1/modules", params={"run_id": run_id}).json()["data"]]


def test_sigkilled_island_lease_expires_and_another_island_finishes(
    cluster: Cluster, engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster.start_coordinator()
    with cluster.admin() as client:
        run_id = create_run(client, {**ONE_PATH, "name": "kill", "lease_ttl_s": 3})
        doomed = start_stalled(cluster, monkeypatch, "doomed", "0:1:600")
        wait_for("doomed holds a lease", stalling(cluster, "doomed"), timeout_s=30, cluster=cluster, logs=("doomed",))
        (held,) = leases(engine)
        assert (held.island, held.round, held.status) == ("doomed", 0, "active")

        doomed.send_signal(signal.SIGKILL)
        assert doomed.wait(timeout=10) == -signal.SIGKILL
        killed_at = time.monotonic()
        rescuer = cluster.start_island("rescuer", *FAST_RETRY)
        wait_finished(cluster, client, run_id, timeout_s=60)
        took = time.monotonic() - killed_at
        assert rescuer.wait(timeout=30) == 0, cluster.log("rescuer")

    assert module_versions(cluster, run_id) == [2, 2, 2]  # one outer step per round, never two
    rows = leases(engine)
    assert rows[0].id == held.id and rows[0].status == "expired"  # the lease died with its island
    assert [(r.island, r.round, r.path_id, r.status) for r in rows[1:]] == [
        ("rescuer", 0, held.path_id, "submitted"),
        ("rescuer", 1, held.path_id, "submitted"),
    ]
    assert took >= 2.5  # the path came back only once the 3 s TTL had run out, not before


def test_coordinator_restart_while_islands_train(
    cluster: Cluster, engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = {**ONE_PATH, "name": "restart", "layout": "embed:shared, b0-1:routed2, head:shared", "lease_ttl_s": 30}
    first = cluster.start_coordinator()
    with cluster.admin() as client:
        run_id = create_run(client, spec)
        # Both islands stall 2.5 s at the start of round 1, so their uploads fall in the coordinator's downtime.
        names = ("island-a", "island-b")
        islands = [start_stalled(cluster, monkeypatch, n, "1:0:2.5") for n in names]
        for n in names:
            wait_for(f"{n} stalls in round 1", stalling(cluster, n), timeout_s=40, cluster=cluster, logs=names)
    first.send_signal(signal.SIGTERM)
    assert first.wait(timeout=15) in (0, -signal.SIGTERM)
    time.sleep(3)
    second = cluster.start_coordinator()
    assert second.pid != first.pid
    with cluster.admin() as client:
        wait_finished(cluster, client, run_id, timeout_s=60)
        for n, proc in zip(names, islands, strict=True):
            assert proc.wait(timeout=30) == 0, cluster.log(n)

    assert module_versions(cluster, run_id) == [2, 2, 2, 2]
    for n in names:  # the restart was noticed: heartbeats and the round-1 upload had to be retried
        log = cluster.log(n)
        assert "heartbeat failed" in log or "heartbeat of island" in log, log
        assert "upload for lease" in log and "retrying in" in log, log
    rows = leases(engine)
    assert {r.status for r in rows} == {"submitted"}  # no lease was lost to the restart
    assert sorted((r.round, r.path_id) for r in rows) == sorted({(r.round, r.path_id) for r in rows})
    assert len(rows) == 4  # 2 paths x 2 rounds


def test_island_started_before_the_coordinator_waits_then_joins(cluster: Cluster, engine: Engine) -> None:
    early = cluster.start_island("early", *FAST_RETRY, "--give-up-after", "90")
    wait_for(
        "early retries its join",
        lambda: "join as 'early'" in cluster.log("early") and "retrying in" in cluster.log("early"),
        timeout_s=30,
        cluster=cluster,
        logs=("early",),
    )
    time.sleep(1)
    assert early.poll() is None, cluster.log("early")  # still waiting, not given up
    cluster.start_coordinator()
    with cluster.admin() as client:
        run_id = create_run(client, {**ONE_PATH, "name": "early", "lease_ttl_s": 30})
        wait_finished(cluster, client, run_id, timeout_s=60)
    assert early.wait(timeout=30) == 0, cluster.log("early")
    assert module_versions(cluster, run_id) == [2, 2, 2]
    assert [(r.island, r.round, r.status) for r in leases(engine)] == [
        ("early", 0, "submitted"),
        ("early", 1, "submitted"),
    ]


def test_ctrl_c_releases_the_lease_at_once(cluster: Cluster, engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    ttl = 120
    cluster.start_coordinator()
    with cluster.admin() as client:
        run_id = create_run(client, {**ONE_PATH, "name": "ctrl-c", "lease_ttl_s": ttl})
        quitter = start_stalled(cluster, monkeypatch, "quitter", "0:1:600")
        wait_for(
            "quitter holds a lease", stalling(cluster, "quitter"), timeout_s=30, cluster=cluster, logs=("quitter",)
        )
        taker = cluster.start_island("taker", *FAST_RETRY)
        # The taker is up and asking (and being told to wait) before the Ctrl-C.
        wait_for(
            "taker joined",
            lambda: "joined" in cluster.log("taker"),
            timeout_s=30,
            cluster=cluster,
            logs=("taker",),
        )
        (held,) = leases(engine)
        assert held.island == "quitter"

        quitter.send_signal(signal.SIGINT)
        assert quitter.wait(timeout=15) == 128 + signal.SIGINT, cluster.log("quitter")
        took = wait_for(
            "taker gets the released path",
            lambda: any(r.island == "taker" and r.round == 0 for r in leases(engine)),
            timeout_s=10,
            cluster=cluster,
            logs=("quitter", "taker"),
        )
        wait_finished(cluster, client, run_id, timeout_s=60)
        assert taker.wait(timeout=30) == 0, cluster.log("taker")

    assert took < 10 < ttl
    rows = leases(engine)
    assert (rows[0].id, rows[0].status) == (held.id, "released")
    assert [(r.island, r.round, r.path_id, r.status) for r in rows[1:]] == [
        ("taker", 0, held.path_id, "submitted"),
        ("taker", 1, held.path_id, "submitted"),
    ]
    assert module_versions(cluster, run_id) == [2, 2, 2]
    assert "released lease" in cluster.log("quitter")


def test_sigterm_under_torchrun_stops_both_ranks_together_and_releases_the_lease(
    cluster: Cluster, engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torchrun's agent passes SIGTERM to every rank at once (a Kubernetes pod being deleted). The follower used
    to die at once, so rank 0's next collective failed ("Connection reset by peer") before it released; now the
    follower keeps following for `FOLLOWER_TERM_GRACE_S`, both ranks stop at one step, rank 0 releases the lease
    and sends `stop`."""
    cluster.start_coordinator()
    with cluster.admin() as client:
        spec = {
            **ONE_PATH,
            "name": "torchrun-term",
            "lease_ttl_s": 120,
            "inner": {**ONE_PATH["inner"], "batch_size": 4},
        }
        create_run(client, spec)
        quitter = start_stalled(cluster, monkeypatch, "quitter", "0:1:600", wrap=TORCHRUN_2)
        wait_for(
            "quitter holds a lease", stalling(cluster, "quitter"), timeout_s=60, cluster=cluster, logs=("quitter",)
        )
        quitter.send_signal(signal.SIGTERM)
        quitter.wait(timeout=30)  # torchrun's own exit code is 1 (its SignalException), whatever the ranks did

    log = cluster.log("quitter")
    (held,) = leases(engine)
    assert held.status == "released", log
    assert "released lease" in log and "x 2 process(es)" in log
    assert "Connection reset" not in log and "RuntimeError" not in log, log


def _children(pid: int, running: str) -> list[int]:
    """Processes whose parent is `pid` and whose command line holds `running` (from /proc: no ps needed)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError):
            continue  # gone meanwhile
        if int(fields[1]) == pid and running in cmdline:
            found.append(int(stat.parent.name))
    return found


def test_a_follower_that_dies_stops_the_island_with_one_line_and_no_lease_held(
    cluster: Cluster, engine: Engine
) -> None:
    """A follower SIGKILLed (OOM killer, say): rank 0's next collective fails; it says so in one line (not an
    "island crashed" traceback), releases what it holds and exits 1."""
    cluster.start_coordinator()
    island = cluster.start_island("lonely", *FAST_RETRY, "--nproc", "2")
    wait_for(
        "lonely joined", lambda: "joined" in cluster.log("lonely"), timeout_s=60, cluster=cluster, logs=("lonely",)
    )
    (follower,) = _children(island.pid, "island.follower")
    os.kill(follower, signal.SIGKILL)
    with cluster.admin() as client:
        create_run(client, {**ONE_PATH, "name": "lonely", "inner": {**ONE_PATH["inner"], "batch_size": 4}})
        assert island.wait(timeout=60) == 1, cluster.log("lonely")

    log = " ".join(cluster.log("lonely").split())  # rich wraps long lines in its message column
    # gloo says "Connection closed by peer" or "Read error ...: Connection reset by peer", by timing
    assert "a follower rank is gone or stuck (the island's process group failed:" in log and "by peer" in log, log
    assert "island crashed" not in log and "Traceback" not in log, log
    assert all(row.status == "released" for row in leases(engine)), leases(engine)
