"""A real coordinator process on a free port, and island processes, for integration tests.

`Cluster.admin()` is a raw `httpx.Client` with the admin token (tests read the HTTP surface with it); the helpers
here set runs up and wait through the typed client (`coordinator.client.CoordinatorClient`) on top of it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import pytest

from coordinator.client import CoordinatorClient, CoordinatorUnavailable, RetryPolicy
from coordinator.states import IslandStatus, RunStatus
from island.distributed import free_port
from tests.conftest import ADMIN, JOIN

ISLAND_DEVICE = os.environ.get("DIPACO_TEST_ISLAND_DEVICE", "cpu")
"""`--device` of the islands these tests start: cpu here and in CI; bench/gpu_check.sh sets cuda on a GPU machine."""
TORCHRUN_2 = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--no-python")
"""`Cluster.start_island(..., wrap=TORCHRUN_2)`: the island as two ranks under torchrun (the Kubernetes GPU launch)."""


@dataclass
class Cluster:
    """Processes started by a test; everything is stopped at teardown."""

    tmp: Path
    database_url: str
    port: int = field(default_factory=free_port)
    host: str = "127.0.0.1"
    """Address the coordinator binds and the islands reach (tests/chaos: one on an emulated WAN)."""
    coordinator: subprocess.Popen[bytes] | None = None
    islands: list[subprocess.Popen[bytes]] = field(default_factory=list)
    replicas: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def data_dir(self) -> Path:
        return self.tmp / "coordinator"

    def env(self) -> dict[str, str]:
        return {**os.environ, "DIPACO_ADMIN_TOKEN": ADMIN, "DIPACO_JOIN_TOKEN": JOIN, "OMP_NUM_THREADS": "1"}

    def start_coordinator(
        self, *, wait: bool = True, env: dict[str, str] | None = None, port: int | None = None
    ) -> subprocess.Popen[bytes]:
        """Start the coordinator on `self.port`; with another `port`, start an extra replica (same DB, blobs)."""
        replica = port is not None and port != self.port
        log = (self.tmp / ("coordinator.log" if not replica else f"coordinator-{port}.log")).open("ab")
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "dipaco",
                "coordinator",
                "serve",
                "--host",
                self.host,
                "--port",
                str(port or self.port),
                "--data-dir",
                str(self.data_dir),
                "--database-url",
                self.database_url,
                "--log-level",
                "warning",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**self.env(), **(env or {})},
        )
        if replica:
            self.replicas.append(proc)
            if wait:
                self.wait_healthy(proc=proc, url=f"http://127.0.0.1:{port}")
            return proc
        self.coordinator = proc
        if wait:
            self.wait_healthy()
        return proc

    def wait_healthy(
        self, timeout_s: float = 60, *, proc: subprocess.Popen[bytes] | None = None, url: str | None = None
    ) -> None:
        proc = proc or self.coordinator
        deadline = time.monotonic() + timeout_s
        with CoordinatorClient(url or self.url, ADMIN, timeout=httpx.Timeout(2.0), retry=RetryPolicy.once()) as probe:
            while time.monotonic() < deadline:
                assert proc is not None and proc.poll() is None, self.log("coordinator")
                try:
                    probe.health()
                    return
                except CoordinatorUnavailable:
                    pass
                time.sleep(0.2)
        raise TimeoutError(f"coordinator not healthy after {timeout_s} s\n{self.log('coordinator')}")

    def start_island(
        self, name: str, *extra: str, url: str | None = None, wrap: Sequence[str] = ()
    ) -> subprocess.Popen[bytes]:
        """An island process; `wrap` prefixes its command (e.g. `ip netns exec NS` to run it on another host)."""
        log = (self.tmp / f"{name}.log").open("ab")
        proc = subprocess.Popen(
            [
                *wrap,
                sys.executable,
                "-m",
                "dipaco",
                "island",
                "join",
                "--coordinator",
                url or self.url,
                "--token",
                JOIN,
                "--name",
                name,
                "--cache-dir",
                str(self.tmp / name),
                "--device",
                ISLAND_DEVICE,
                "--quiet",
                *extra,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.env(),
        )
        self.islands.append(proc)
        return proc

    def log(self, name: str) -> str:
        path = self.tmp / f"{name}.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else "(no log)"

    def admin(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=30, headers={"Authorization": f"Bearer {ADMIN}"})

    def stop(self) -> None:
        procs = [*self.islands, *self.replicas, *([self.coordinator] if self.coordinator else [])]
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


FULL_MATRIX = os.environ.get("DIPACO_FULL_MATRIX") == "1"
"""Island-behaviour tests run on SQLite only unless DIPACO_FULL_MATRIX=1: what they test does not depend on the
database, and the coordinator's own tests (crash, replicas, protocol) cover PostgreSQL."""
ISLAND_DB_PARAMS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)] if FULL_MATRIX else ["sqlite"]


def island_database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'registry.db'}"
    url: str = request.getfixturevalue("postgres_url")
    return url


@pytest.fixture
def cluster(tmp_path: Path, database_url: str) -> Iterator[Cluster]:
    c = Cluster(tmp=tmp_path, database_url=database_url)
    try:
        yield c
    finally:
        c.stop()


def typed(client: httpx.Client) -> CoordinatorClient:
    """The typed admin client over a test's raw one (same connection pool; closing it leaves `client` open)."""
    return CoordinatorClient(str(client.base_url), ADMIN, http=client)


def create_run(client: httpx.Client, spec: dict[str, object], *, num_tokens: int = 2000, seed: int = 0) -> int:
    admin = typed(client)
    run = admin.create_run(spec)
    rng = np.random.default_rng(seed)
    for p in range(run.num_paths):
        # Each path gets its own "domain": a different small alphabet, so the paths really differ.
        body = rng.integers(32 + 10 * p, 48 + 10 * p, num_tokens).astype("<u2").tobytes()
        admin.register_shard(run.id, p, body, num_documents=1)
    return run.id


def wait_finished(cluster: Cluster, client: httpx.Client, run_id: int, timeout_s: float = 240) -> dict[str, object]:
    """The run, as JSON, once it is finished."""
    admin = typed(client)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        run = admin.run(run_id)
        if run.status == RunStatus.FINISHED:
            return run.model_dump(mode="json")
        time.sleep(0.3)
    logs = "\n".join(
        f"--- island {name} (exit code {proc.poll()}):\n{cluster.log(name)[-1500:]}"
        for proc in cluster.islands
        for name in [_island_name(proc)]
    )
    raise TimeoutError(f"run {run_id} not finished after {timeout_s} s: {run}\n{logs}\n{cluster.log('coordinator')}")


def _island_name(proc: subprocess.Popen[bytes]) -> str:
    args = [str(a) for a in proc.args] if isinstance(proc.args, list) else [str(proc.args)]
    return args[args.index("--name") + 1] if "--name" in args else " ".join(args)


def wait_islands_joined(client: httpx.Client, count: int, timeout_s: float = 60) -> None:
    """Wait until `count` islands are registered (so work starts only once all of them are there)."""
    admin = typed(client)
    deadline = time.monotonic() + timeout_s
    while len(admin.islands(status=IslandStatus.ACTIVE)) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"fewer than {count} islands joined within {timeout_s} s")
        time.sleep(0.2)
