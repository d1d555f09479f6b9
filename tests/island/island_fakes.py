"""A hand-written fake coordinator for the client's own tests (tests/island/test_island_client.py): real HTTP
semantics over `httpx.MockTransport`. The island's tests do not use it: they run against the real app
(tests/island/real_coordinator.py, tests/island/faulty_transport.py); this fake goes once the client tests stop
using it.

It implements the island-facing endpoints of the REST contract with in-memory state, a plain outer step
(new weights = base - averaged outer gradient, i.e. outer lr 1 without momentum) and fault injection keyed
by endpoint.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import numpy as np

from coordinator.schemas import GRAD_KEY_SEP, H_ROUND, H_TOKENS, H_TRAIN_LOSS
from modules import ModelConfig, decode, encode, flavour, grid_layout, init_level_modules
from modules.layout import Layout

JOIN_TOKEN = "join-secret"
BASE_URL = "http://coordinator.test"


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass
class Upload:
    lease_id: int
    headers: dict[str, str]
    body: bytes


@dataclass
class Fault:
    status: int
    headers: dict[str, str] = field(default_factory=dict)
    detail: str = "injected fault"


class FakeCoordinator:
    """In-memory coordinator. `plan` lists the path index of each lease it will hand out, in order."""

    def __init__(
        self,
        *,
        plan: list[int],
        inner_steps: int = 3,
        batch_size: int = 2,
        heartbeat_interval_s: float = 0.05,
        model: ModelConfig | None = None,
        routed: tuple[int, ...] = (2, 2),
        seed: int = 0,
    ) -> None:
        self.model = model or flavour("debug")
        self.layout: Layout = grid_layout(n_layers=self.model.n_layers, routed=list(routed))
        self.plan = list(plan)
        self.inner_steps = inner_steps
        self.batch_size = batch_size
        self.heartbeat_interval_s = heartbeat_interval_s
        self.lock = threading.RLock()
        self.blobs: dict[str, bytes] = {}
        # module id -> list of weight blobs hashes by version; ids are 100 * level + index + 1
        self.versions: dict[int, list[str]] = {}
        init = init_level_modules(self.model, self.layout, seed=seed)
        for li in range(len(self.layout.levels)):
            for k in range(self.layout.num_modules(li)):
                self.versions[self.module_id(li, k)] = [self._store(encode(init[li]))]
        self.need = inner_steps * batch_size * self.model.seq_len + 1
        gen = np.random.default_rng(seed)
        self.shards: dict[int, str] = {}
        for p in range(self.layout.num_paths):
            tokens = gen.integers(0, self.model.vocab_size, size=self.need * (len(plan) + 1), dtype="<u2")
            self.shards[p] = self._store(tokens.astype("<u2").tobytes())
        self.island_token: str | None = None
        self.leases: dict[int, dict[str, Any]] = {}
        self.uploads: list[Upload] = []
        self.upload_attempts: list[int] = []
        self.released: list[int] = []
        self.left = False
        self.heartbeats = 0
        self.requests: list[tuple[str, str]] = []
        self.faults: dict[str, list[Fault]] = {}
        self.conflict_leases: set[int] = set()
        self.corrupt_weights = 0
        self.idle_first: list[tuple[str, str]] = []
        """(X-Dipaco-Idle, Retry-After) 204 replies to give before handing out the plan."""
        self.cursor: dict[int, int] = {}
        self.round = 0

    # -- helpers --------------------------------------------------------------------------------------------

    @staticmethod
    def module_id(level: int, index: int) -> int:
        return 100 * level + index + 1

    def _store(self, data: bytes) -> str:
        digest = sha(data)
        self.blobs[digest] = data
        return digest

    def fail(self, endpoint: str, *faults: int | Fault) -> None:
        self.faults.setdefault(endpoint, []).extend(f if isinstance(f, Fault) else Fault(f) for f in faults)

    def count(self, method: str, pattern: str) -> int:
        return sum(1 for m, p in self.requests if m == method and re.fullmatch(pattern, p))

    @staticmethod
    def _error(status: int, detail: str, headers: dict[str, str] | None = None) -> httpx.Response:
        return httpx.Response(status, json={"detail": detail}, headers=headers)

    # -- dispatch -------------------------------------------------------------------------------------------

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = request.read()
        with self.lock:
            path = request.url.path
            self.requests.append((request.method, path))
            routes: list[tuple[str, str, str, Callable[..., httpx.Response]]] = [
                ("POST", r"/v1/islands", "join", self._join),
                ("POST", r"/v1/islands/(\d+)/heartbeat", "heartbeat", self._heartbeat),
                ("POST", r"/v1/islands/(\d+)/lease", "lease", self._lease),
                ("DELETE", r"/v1/islands/(\d+)", "leave", self._leave),
                ("GET", r"/v1/modules/(\d+)/weights", "weights", self._weights),
                ("GET", r"/v1/shards/(\d+)/tokens", "tokens", self._tokens),
                ("POST", r"/v1/leases/(\d+)/outer-gradients", "upload", self._upload),
                ("POST", r"/v1/leases/(\d+)/release", "release", self._release),
            ]
            for method, pattern, name, handler in routes:
                m = re.fullmatch(pattern, path)
                if m is None or request.method != method:
                    continue
                if name == "upload":
                    self.upload_attempts.append(int(m.group(1)))
                queue = self.faults.get(name)
                if queue:
                    fault = queue.pop(0)
                    return self._error(fault.status, fault.detail, fault.headers)
                token = request.headers.get("Authorization", "").removeprefix("Bearer ")
                if name in ("weights", "tokens"):  # any valid token
                    valid = {JOIN_TOKEN, self.island_token}
                else:
                    valid = {JOIN_TOKEN} if name == "join" else {self.island_token}
                if token not in valid - {None}:
                    return self._error(401, "invalid or missing bearer token")
                return handler(request, body, *(int(g) for g in m.groups()))
            return self._error(404, f"no route {request.method} {path}")

    # -- endpoints ------------------------------------------------------------------------------------------

    def _join(self, request: httpx.Request, body: bytes) -> httpx.Response:
        payload = json.loads(body)
        assert set(payload) <= {"name", "site", "capabilities"}
        self.island_token = "island-secret"
        return httpx.Response(
            201, json={"island_id": 7, "token": self.island_token, "heartbeat_interval_s": self.heartbeat_interval_s}
        )

    def _heartbeat(self, request: httpx.Request, body: bytes, island_id: int) -> httpx.Response:
        self.heartbeats += 1
        active = [i for i, lease in self.leases.items() if lease["status"] == "active"]
        return httpx.Response(
            200,
            json={
                "island_id": island_id,
                "active_lease_ids": active,
                "heartbeat_interval_s": self.heartbeat_interval_s,
            },
        )

    def _leave(self, request: httpx.Request, body: bytes, island_id: int) -> httpx.Response:
        self.left = True
        return httpx.Response(204)

    def _lease(self, request: httpx.Request, body: bytes, island_id: int) -> httpx.Response:
        if self.idle_first:
            reason, retry_after = self.idle_first.pop(0)
            return httpx.Response(204, headers={"X-Dipaco-Idle": reason, "Retry-After": retry_after})
        if not self.plan:
            return httpx.Response(204, headers={"X-Dipaco-Idle": "no-running-runs"})
        path_index = self.plan.pop(0)
        lease_id = len(self.leases) + 1
        module_indices = self.layout.path_modules(path_index)
        modules = []
        for li, (level, k) in enumerate(zip(self.layout.levels, module_indices, strict=True)):
            mid = self.module_id(li, k)
            version = len(self.versions[mid]) - 1
            modules.append(
                {
                    "level": li,
                    "level_name": level.name,
                    "module_id": mid,
                    "version": version,
                    "weights_hash": self.versions[mid][version],
                }
            )
        start = self.cursor.get(path_index, 0)
        self.cursor[path_index] = start + self.need - 1
        shard_hash = self.shards[path_index]
        lease = {
            "lease_id": lease_id,
            "run_id": 1,
            "round": self.round,
            "path_id": 10 + path_index,
            "path_index": path_index,
            "model": self.model.to_dict(),
            "inner": {"lr": 3e-3, "warmup_steps": 2, "total_steps": 100, "batch_size": self.batch_size},
            "inner_steps": self.inner_steps,
            "first_step": self.round * self.inner_steps,
            "modules": modules,
            "shard": {
                "shard_id": 50 + path_index,
                "tokens_hash": shard_hash,
                "num_tokens": len(self.blobs[shard_hash]) // 2,
            },
            "token_start": start,
            "token_end": start + self.need,
            "epoch": 0,
            "seed": 1234 + lease_id,
            "expires_at": (datetime.now(UTC) + timedelta(minutes=2)).isoformat(),
            "status": "active",
        }
        self.leases[lease_id] = lease
        self.round += 1
        return httpx.Response(200, json=lease)

    def _weights(self, request: httpx.Request, body: bytes, module_id: int) -> httpx.Response:
        versions = self.versions.get(module_id)
        if versions is None:
            return self._error(404, f"module {module_id} does not exist")
        version = int(request.url.params.get("version", len(versions) - 1))
        if not 0 <= version < len(versions):
            return self._error(404, f"module {module_id} has no version {version}")
        digest = versions[version]
        data = self.blobs[digest]
        if self.corrupt_weights > 0:
            self.corrupt_weights -= 1
            data = data[:-1] + bytes([data[-1] ^ 0xFF])
        return httpx.Response(200, content=data, headers={"ETag": f'"{digest}"'})

    def _tokens(self, request: httpx.Request, body: bytes, shard_id: int) -> httpx.Response:
        digest = self.shards[shard_id - 50]
        return httpx.Response(200, content=self.blobs[digest], headers={"ETag": f'"{digest}"'})

    def _release(self, request: httpx.Request, body: bytes, lease_id: int) -> httpx.Response:
        lease = self.leases.get(lease_id)
        if lease is None or lease["status"] != "active":
            return self._error(409, f"lease {lease_id} is not active")
        lease["status"] = "released"
        self.released.append(lease_id)
        return httpx.Response(200, json={"detail": "released"})

    def _upload(self, request: httpx.Request, body: bytes, lease_id: int) -> httpx.Response:
        lease = self.leases.get(lease_id)
        if lease is None:
            return self._error(404, f"lease {lease_id} does not exist")
        if lease_id in self.conflict_leases:
            lease["status"] = "expired"
            return self._error(409, f"lease {lease_id} was issued for round {lease['round']}, the round is closed")
        if int(request.headers[H_ROUND]) != lease["round"]:
            return self._error(400, f"lease {lease_id} is for round {lease['round']}")
        contribution = {
            "id": lease_id,
            "lease_id": lease_id,
            "run_id": 1,
            "round": lease["round"],
            "path_index": lease["path_index"],
            "tokens": int(request.headers[H_TOKENS]),
            "train_loss": float(request.headers[H_TRAIN_LOSS]),
            "status": "accepted",
            "round_applied": True,
        }
        if lease["status"] == "submitted":  # idempotent retry
            return httpx.Response(200, json=contribution)
        grads = decode(body)
        self.uploads.append(Upload(lease_id, dict(request.headers), body))
        lease["status"] = "submitted"
        for module in lease["modules"]:
            base = decode(self.blobs[module["weights_hash"]])
            prefix = module["level_name"] + GRAD_KEY_SEP
            new = {name: base[name] - grads[prefix + name] for name in base}
            self.versions[module["module_id"]].append(self._store(encode(new)))
        return httpx.Response(200, json=contribution)
