"""A real coordinator process on a free port, and island processes, for integration tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.conftest import ADMIN, JOIN


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Cluster:
    """Processes started by a test; everything is stopped at teardown."""

    tmp: Path
    database_url: str
    port: int = field(default_factory=free_port)
    coordinator: subprocess.Popen[bytes] | None = None
    islands: list[subprocess.Popen[bytes]] = field(default_factory=list)
    replicas: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

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
        while time.monotonic() < deadline:
            assert proc is not None and proc.poll() is None, self.log("coordinator")
            try:
                if httpx.get(f"{url or self.url}/healthz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"coordinator not healthy after {timeout_s} s\n{self.log('coordinator')}")

    def start_island(self, name: str, *extra: str, url: str | None = None) -> subprocess.Popen[bytes]:
        log = (self.tmp / f"{name}.log").open("ab")
        proc = subprocess.Popen(
            [
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
                "cpu",
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


def create_run(client: httpx.Client, spec: dict[str, object], *, num_tokens: int = 2000, seed: int = 0) -> int:
    r = client.post("/v1/runs", json=spec)
    assert r.status_code == 201, r.text
    run = r.json()
    rng = np.random.default_rng(seed)
    for p in range(run["num_paths"]):
        # Each path gets its own "domain": a different small alphabet, so the paths really differ.
        body = rng.integers(32 + 10 * p, 48 + 10 * p, num_tokens).astype("<u2").tobytes()
        s = client.post(f"/v1/runs/{run['id']}/shards/{p}", params={"num_documents": 1}, content=body)
        assert s.status_code == 201, s.text
    return int(run["id"])


def wait_finished(cluster: Cluster, client: httpx.Client, run_id: int, timeout_s: float = 240) -> dict[str, object]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        run = client.get(f"/v1/runs/{run_id}").json()
        if run["status"] == "finished":
            return dict(run)
        time.sleep(0.3)
    logs = "\n".join(f"--- {p.args[9] if len(p.args) > 9 else p.args}: {p.poll()}" for p in cluster.islands)
    raise TimeoutError(f"run {run_id} not finished after {timeout_s} s: {run}\n{logs}\n{cluster.log('coordinator')}")


def wait_islands_joined(client: httpx.Client, count: int, timeout_s: float = 60) -> None:
    """Wait until `count` islands are registered (so work starts only once all of them are there)."""
    deadline = time.monotonic() + timeout_s
    while client.get("/v1/islands", params={"status": "active"}).json()["count"] < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"fewer than {count} islands joined within {timeout_s} s")
        time.sleep(0.2)
