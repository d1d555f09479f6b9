"""The REAL coordinator app for island tests: `create_app` behind Starlette's TestClient, on the test's database
(SQLite, or PostgreSQL when one answers) and the fake clock (fixtures in conftest.py). Each island talks to it
through its own `FaultyTransport`, so a test can inject the faults the app cannot produce and read back every
exchange."""

from __future__ import annotations

import hashlib
import io
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch
from fastapi.testclient import TestClient
from rich.console import Console

from coordinator.schemas import LeasePublic
from coordinator.settings import Settings
from island.client import CoordinatorClient, RetryPolicy
from island.worker import Island, IslandConfig
from modules import decode
from tests.conftest import JOIN, FakeClock
from tests.coordinator.helpers import A, create_running_run
from tests.island.faulty_transport import FaultyTransport

ONE_PATH = "embed:shared, b0-1:shared, head:shared"
"""Every level shared: one path, so each round is one lease."""
TWO_PATHS = "embed:shared, b0-1:routed2, head:shared"
"""Two paths sharing the embedding and the head."""


@dataclass
class Coordinator:
    """The real coordinator app and the islands a test wires to it."""

    app: TestClient
    clock: FakeClock
    settings: Settings
    tmp_path: Path
    islands: list[Island] = field(default_factory=list)
    transports: list[FaultyTransport] = field(default_factory=list)

    def transport(self) -> FaultyTransport:
        """A transport to the app, shut before the app stops (`close`)."""
        transport = FaultyTransport(self.app)
        self.transports.append(transport)
        return transport

    def close(self) -> None:
        """Stop the app once no island request is in flight; later ones are refused as by a stopped server."""
        try:
            for transport in self.transports:
                transport.shut()
        finally:  # a request stuck past the bound fails the test, and the app still stops
            self.app.__exit__(None, None, None)

    def create_run(self, **overrides: Any) -> dict[str, Any]:
        """A running run (tests.coordinator.helpers.TINY_RUN with `overrides`) with its shards registered."""
        return create_running_run(self.app, **overrides)

    def island(
        self, *, token: str = JOIN, give_up_after_s: float = 2.0, **overrides: Any
    ) -> tuple[Island, FaultyTransport]:
        """An island (CPU, no probe, no signal handlers, no progress bar, no long polling) and its transport;
        its client retries for `give_up_after_s` with millisecond backoffs."""
        transport = self.transport()
        base_url = str(self.app.base_url)
        http = httpx.Client(transport=transport, base_url=base_url)
        retry = RetryPolicy(give_up_after_s=give_up_after_s, base_s=0.001, cap_s=0.01)
        client = CoordinatorClient(base_url, token, http=http, retry=retry)
        config = IslandConfig(
            **{
                "coordinator": base_url,
                "token": token,
                "name": f"island-{len(self.islands)}",
                "device": "cpu",
                "cache_dir": self.tmp_path / f"cache-{len(self.islands)}",
                "quiet": True,
                "probe": False,
                "handle_signals": False,
                "lease_wait_s": 0.0,
                **overrides,
            }
        )
        island = Island(config, client=client, console=Console(file=io.StringIO(), width=120))
        self.islands.append(island)
        return island, transport

    def get(self, url: str, **params: Any) -> Any:
        """GET with the admin token; the JSON body."""
        r = self.app.get(url, params=params, headers=A)
        assert r.status_code == 200, r.text
        return r.json()

    def weights(self, module_id: int, version: int) -> dict[str, torch.Tensor]:
        r = self.app.get(f"/v1/modules/{module_id}/weights", params={"version": version}, headers=A)
        assert r.status_code == 200, r.text
        return decode(r.content)

    def tokens(self, lease: LeasePublic) -> torch.Tensor:
        """The lease's token range, as the island reads it."""
        r = self.app.get(f"/v1/shards/{lease.shard.shard_id}/tokens", headers=A)
        assert r.status_code == 200, r.text
        shard = np.frombuffer(r.content, dtype="<u2")
        return torch.from_numpy(shard[lease.token_start : lease.token_end].astype("int64"))

    def stored_blob(self, digest: str, *, timeout_s: float = 10.0) -> bytes:
        """A blob from the coordinator's blob store (an accepted upload is stored as received, by its sha256).
        An upload that named its sha256 waits in the staging area until an apply executor has verified it and
        given it that name: it is read from there meanwhile (and must hash to `digest` too)."""
        blobs: Any = self.app.app.state.dipaco.blobs
        deadline = time.monotonic() + timeout_s
        while True:
            if blobs.exists(digest):
                data: bytes = blobs.get_bytes(digest)
                return data
            for staged in (blobs.root / "staging").glob(f"*-{digest}"):
                try:
                    data = staged.read_bytes()
                except FileNotFoundError:  # promoted and removed meanwhile: look again
                    continue
                assert hashlib.sha256(data).hexdigest() == digest, staged
                return data
            assert time.monotonic() < deadline, f"no blob {digest}, stored or staged"
            time.sleep(0.02)
