"""A real coordinator and real islands on this machine, as subprocesses: shared by `dipaco demo` and the quality
driver (`dipaco.quality`).

`LocalService` starts `dipaco coordinator serve` on a free port (SQLite + blob directory under its data dir)
with fresh admin / join tokens, and `dipaco island join` processes on demand; every process logs to its own file
and everything is stopped (SIGTERM, then SIGKILL after a timeout) by `stop()` / leaving the `with` block. Its
admin `client` is the one typed client (`coordinator.client.CoordinatorClient`).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from coordinator.client import CoordinatorClient, CoordinatorUnavailable, RetryPolicy
from coordinator.schemas import RunCreate, RunPublic
from coordinator.states import IslandStatus, RunStatus
from island.distributed import free_port

log = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 60.0
"""How long a fresh coordinator may take to answer /healthz (imports torch, runs migrations)."""
STOP_TIMEOUT_S = 15.0
"""SIGTERM grace period before a process is killed."""
CLIENT_GIVE_UP_S = 30.0
"""How long one admin request keeps retrying a coordinator that does not answer (it runs on this machine: longer
means it is gone)."""


class ServiceError(RuntimeError):
    """A process of the local service failed to start, exited early, or a run did not finish."""


def tail(path: Path, lines: int = 15) -> str:
    """The last lines of a log file ('' when it cannot be read)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def stop_process(proc: subprocess.Popen[bytes], name: str, timeout_s: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM, wait, then SIGKILL; a process that already exited is left alone."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        log.warning("%s did not stop within %.0f s; killing it", name, timeout_s)
        proc.kill()
        proc.wait()


@dataclass
class LocalService:
    """One coordinator subprocess (SQLite + blobs in `data_dir`) and the island subprocesses started on it."""

    data_dir: Path
    logs: Path
    threads_per_process: int = 1
    """OMP/torch threads of every subprocess (one per island keeps N islands on N cores from oversubscribing)."""
    admin_token: str = field(default_factory=lambda: f"admin_{secrets.token_urlsafe(24)}")
    join_token: str = field(default_factory=lambda: f"join_{secrets.token_urlsafe(24)}")
    port: int = field(default_factory=free_port)
    procs: list[tuple[str, subprocess.Popen[bytes]]] = field(default_factory=list)
    _client: CoordinatorClient | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def dashboard_url(self) -> str:
        """The web dashboard (it asks for a token: the admin token in `token_file`)."""
        return f"{self.url}/ui/"

    @property
    def token_file(self) -> Path:
        """`tokens.json` in the data directory (0600), as the coordinator writes it when it generates tokens: a
        coordinator started again on this directory without DIPACO_* tokens reads the same ones."""
        return self.data_dir / "tokens.json"

    def _write_token_file(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.token_file.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            json.dump({"admin_token": self.admin_token, "join_token": self.join_token}, out, indent=2)
        os.replace(tmp, self.token_file)

    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "DIPACO_ADMIN_TOKEN": self.admin_token,
            "DIPACO_JOIN_TOKEN": self.join_token,
            "OMP_NUM_THREADS": str(self.threads_per_process),
        }

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        self.logs.mkdir(parents=True, exist_ok=True)
        with (self.logs / f"{name}.log").open("ab") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "dipaco", *args], stdout=out, stderr=subprocess.STDOUT, env=self.env()
            )
        self.procs.append((name, proc))
        return proc

    def start(self) -> LocalService:
        """Start the coordinator and wait until it answers /healthz."""
        self._write_token_file()
        coord = self._spawn(
            "coordinator",
            [
                "coordinator",
                "serve",
                "--port",
                str(self.port),
                "--data-dir",
                str(self.data_dir),
                "--log-level",
                "warning",
            ],
        )
        deadline = time.monotonic() + HEALTH_TIMEOUT_S
        while time.monotonic() < deadline:
            if coord.poll() is not None:
                raise ServiceError(
                    f"coordinator exited with {coord.returncode}; see {self.logs / 'coordinator.log'}:\n"
                    f"{tail(self.logs / 'coordinator.log')}"
                )
            try:
                self.client.health(give_up_after_s=0)
                return self
            except CoordinatorUnavailable:
                pass
            time.sleep(0.3)
        raise ServiceError(f"coordinator did not answer /healthz within {HEALTH_TIMEOUT_S:.0f} s")

    @property
    def client(self) -> CoordinatorClient:
        """The admin client (one per service)."""
        if self._client is None:
            self._client = CoordinatorClient(
                self.url, self.admin_token, retry=RetryPolicy(give_up_after_s=CLIENT_GIVE_UP_S)
            )
        return self._client

    def start_islands(self, count: int, *, prefix: str = "island", cache_root: Path) -> list[str]:
        """Start `count` islands (`dipaco island join --quiet` on CPU); returns their names."""
        names = []
        for i in range(count):
            name = f"{prefix}-{i}"
            self._spawn(
                name,
                [
                    "island",
                    "join",
                    "--coordinator",
                    self.url,
                    "--token",
                    self.join_token,
                    "--name",
                    name,
                    "--site",
                    "local",
                    "--cache-dir",
                    str(cache_root / name),
                    "--device",
                    "cpu",
                    "--quiet",
                ],
            )
            names.append(name)
        return names

    def islands(self) -> list[tuple[str, subprocess.Popen[bytes]]]:
        return [(n, p) for n, p in self.procs if n != "coordinator"]

    def stop_islands(self, *, wait_s: float = 30.0) -> None:
        """Give the islands `wait_s` in all to exit by themselves (they do once their run finished), then stop
        the rest; forget them. `wait_s=0` stops them at once (error paths)."""
        deadline = time.monotonic() + wait_s
        for name, proc in self.islands():
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                stop_process(proc, name)
        self.procs = [(n, p) for n, p in self.procs if n == "coordinator"]

    def create_run(self, spec: RunCreate | Mapping[str, Any]) -> RunPublic:
        return self.client.create_run(spec)

    def wait_finished(
        self, run_id: int, *, poll_s: float = 0.5, on_poll: Callable[[RunPublic], None] | None = None
    ) -> RunPublic:
        """Poll until the run is finished; `on_poll(run)` is called on every poll (progress printing)."""
        while True:
            run = self.client.run(run_id)
            if on_poll is not None:
                on_poll(run)
            if run.status == RunStatus.FINISHED:
                return run
            if not any(p.poll() is None for _, p in self.islands()):
                raise ServiceError(f"every island exited before run {run_id} finished; see the logs in {self.logs}")
            time.sleep(poll_s)

    def wait_islands_joined(self, names: list[str], *, timeout_s: float | None = None) -> None:
        """Wait until every island in `names` is registered and active (default timeout: 60 s + 15 s per island:
        each one imports torch and runs its probe, 16 of them on 2 cores take minutes)."""
        timeout_s = HEALTH_TIMEOUT_S + 15.0 * len(names) if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        while True:
            if set(names) <= {i.name for i in self.client.islands(status=IslandStatus.ACTIVE)}:
                return
            if time.monotonic() > deadline:
                raise ServiceError(f"islands {names} did not all join within {timeout_s:.0f} s; see {self.logs}")
            if not any(p.poll() is None for _, p in self.islands()):
                raise ServiceError(f"every island exited before joining; see the logs in {self.logs}")
            time.sleep(0.2)

    def stop(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
        for name, proc in reversed(self.procs):
            stop_process(proc, name)

    def serve_until_interrupted(self, *, poll_s: float = 1.0) -> None:
        """Keep the coordinator up until Ctrl-C (or SIGTERM, as the caller handles it); raise if it exits."""
        coord = next(p for n, p in self.procs if n == "coordinator")
        try:
            while coord.poll() is None:
                time.sleep(poll_s)
        except KeyboardInterrupt:
            return
        raise ServiceError(f"coordinator exited with {coord.returncode}; see {self.logs / 'coordinator.log'}")

    def log_tails(self) -> dict[str, str]:
        return {name: tail(self.logs / f"{name}.log") for name, _ in self.procs}

    def __enter__(self) -> LocalService:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
