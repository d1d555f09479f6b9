"""`dipaco coordinator apply-worker` as a process of its own, next to a coordinator started with no executor
(`--apply-workers 0`): it applies the round the coordinator closed and stops cleanly on SIGTERM; SIGKILLed in the
middle of a module step (`apply.mid_step`), its step is taken over by another executor and every module is
stepped exactly once."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from coordinator.models import ModuleStep
from coordinator.services.apply import ApplyExecutor, release_dead_claims
from coordinator.settings import Settings
from coordinator.states import StepStatus
from coordinator.timeutil import utcnow
from tests.conftest import FakeClock
from tests.coordinator.helpers import A, closed_round, module_versions
from tests.integration.checks import verify_run


class Workers:
    """`apply-worker` processes started by a test, against the test app's database and blob store; each one
    still running at teardown is killed."""

    def __init__(self, tmp_path: Path, settings: Settings) -> None:
        self.tmp_path, self.settings = tmp_path, settings
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, *extra: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        log = (self.tmp_path / f"apply-worker-{len(self.procs)}.log").open("ab")
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "dipaco",
                "coordinator",
                "apply-worker",
                "--database-url",
                self.settings.resolved_database_url,
                "--blob-url",
                self.settings.resolved_blob_url,
                "--poll-s",
                "0.1",
                *extra,
            ],
            cwd=self.tmp_path,  # its default data directory (.dipaco) lands in the test's directory
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        )
        self.procs.append(proc)
        return proc

    def log(self, proc: subprocess.Popen[bytes]) -> str:
        return (self.tmp_path / f"apply-worker-{self.procs.index(proc)}.log").read_text(errors="replace")[-4000:]


@pytest.fixture
def workers(tmp_path: Path, settings: Settings) -> Iterator[Workers]:
    started = Workers(tmp_path, settings)
    try:
        yield started
    finally:
        for proc in started.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _steps(client: TestClient) -> list[tuple[int, StepStatus, str | None, int]]:
    """(module, status, claimed_by, attempts) of every module step, by module."""
    state = client.app.state.dipaco  # type: ignore[attr-defined]
    with state.sessions() as session:
        rows = session.execute(
            select(ModuleStep.module_id, ModuleStep.status, ModuleStep.claimed_by, ModuleStep.attempts).order_by(
                ModuleStep.module_id
            )
        ).all()
    return [(m, StepStatus(s), c, a) for m, s, c, a in rows]


def _wait_for(
    what: str, ready: Callable[[], bool], proc: subprocess.Popen[bytes], workers: Workers, timeout_s: float = 45
) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert proc.poll() is None, f"apply-worker exited ({proc.returncode}) before {what}\n{workers.log(proc)}"
        assert time.monotonic() < deadline, f"no {what} after {timeout_s} s\n{workers.log(proc)}"
        time.sleep(0.1)


def test_an_apply_worker_process_applies_a_closed_round_and_stops_on_sigterm(
    no_executors: TestClient, workers: Workers
) -> None:
    client = no_executors
    run = closed_round(client)
    assert {status for _, status, _, _ in _steps(client)} == {StepStatus.PENDING}  # the app applies nothing
    worker = workers.start()

    def applied() -> bool:
        return bool(client.get(f"/v1/runs/{run['id']}", headers=A).json()["current_round"] == 1)

    _wait_for("round applied", applied, worker, workers)
    this_worker = f"{socket.gethostname()}-{worker.pid}-0"  # `executor_name` in that process
    assert _steps(client) == [(m, StepStatus.DONE, this_worker, 1) for m in range(1, 7)]
    assert module_versions(client) == {m: [0, 1] for m in range(1, 7)}
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(timeout=30) == 0, workers.log(worker)
    assert "apply worker: 1 executor(s)" in workers.log(worker)
    assert "Traceback" not in workers.log(worker)


def test_a_worker_killed_in_a_module_step_has_it_taken_over_and_each_module_steps_once(
    no_executors: TestClient, clock: FakeClock, settings: Settings, workers: Workers, tmp_path: Path
) -> None:
    client = no_executors
    clock.now = utcnow()  # the worker's clock is the real one: its claim must look fresh to this process
    run = closed_round(client, num_rounds=1)
    data_dir = tmp_path / "worker"
    worker = workers.start("--data-dir", str(data_dir), env={"DIPACO_FAULT_PAUSE_AT": "apply.mid_step"})
    marker = data_dir / "fault-apply.mid_step.reached"
    _wait_for("apply.mid_step reached", marker.exists, worker, workers)
    dead = f"{socket.gethostname()}-{worker.pid}-0"
    held = [(m, status, by) for m, status, by, _ in _steps(client) if status != StepStatus.PENDING]
    assert len(held) == 1 and held[0][1:] == (StepStatus.RUNNING, dead)  # the worker holds one step's claim
    held_module = held[0][0]
    state = client.app.state.dipaco  # type: ignore[attr-defined]
    takeover = ApplyExecutor(sessions=state.sessions, blobs=state.blobs, clock=clock, name="takeover-0")
    assert takeover.work() == 5  # every step but the one a live worker holds
    assert client.get(f"/v1/runs/{run['id']}", headers=A).json()["current_round"] == 0
    worker.send_signal(signal.SIGKILL)
    deadline = time.monotonic() + 10  # not `_wait_for`: its poll() would reap the process
    while Path(f"/proc/{worker.pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z":
        assert time.monotonic() < deadline, "the SIGKILLed worker never became a zombie"
        time.sleep(0.05)
    with state.sessions() as session:  # not reaped yet: it still answers signal 0, and is gone all the same
        assert release_dead_claims(session) == 1
    assert worker.wait(timeout=10) == -signal.SIGKILL  # the fault fired: killed holding the claim, mid-step
    assert takeover.work() == 1
    assert takeover.work() == 0
    assert _steps(client) == [
        (m, StepStatus.DONE, "takeover-0", 2 if m == held_module else 1) for m in range(1, 7)
    ]  # the killed step was claimed twice, committed once
    assert module_versions(client) == {m: [0, 1] for m in range(1, 7)}
    verify_run(settings.resolved_database_url, Path(settings.resolved_blob_url), run["id"])
