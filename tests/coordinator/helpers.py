"""Test helpers that drive the coordinator through its HTTP API, as an island and an admin would."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import numpy as np
import torch
import uvicorn
from fastapi.testclient import TestClient
from sqlalchemy import select

from coordinator.app import create_app
from coordinator.models import ModuleVersion
from coordinator.services.apply import ApplyExecutor
from coordinator.settings import Settings
from modules import ModelConfig, build_path, decode, encode
from modules.outer import pseudo_gradient
from tests.conftest import ADMIN, JOIN, FakeClock

T = TypeVar("T")

A = {"Authorization": f"Bearer {ADMIN}"}
J = {"Authorization": f"Bearer {JOIN}"}

TINY_RUN: dict[str, Any] = {
    "name": "tiny",
    "model": {"flavour": "debug", "d_model": 32, "seq_len": 16, "n_heads": 2},
    "layout": "embed:shared, b0-0:routed2, b1-1:routed2, head:shared",
    "inner": {"batch_size": 2, "warmup_steps": 0},
    "inner_steps": 2,
    "num_rounds": 3,
    "codec": "fp32",  # the tests upload hand-made fp32 payloads
}


def create_running_run(client: TestClient, *, num_tokens: int = 400, **overrides: Any) -> dict[str, Any]:
    spec = {**TINY_RUN, **overrides}
    r = client.post("/v1/runs", json=spec, headers=A)
    assert r.status_code == 201, r.text
    run = r.json()
    rng = np.random.default_rng(0)
    for p in range(run["num_paths"]):
        body = rng.integers(0, 256, num_tokens).astype("<u2").tobytes()
        s = client.post(f"/v1/runs/{run['id']}/shards/{p}?num_documents=2", content=body, headers=A)
        assert s.status_code == 201, s.text
    run = client.get(f"/v1/runs/{run['id']}", headers=A).json()
    assert run["status"] == "running"
    return run


def join(client: TestClient, name: str = "island", *, max_leases: int = 1) -> tuple[int, dict[str, str]]:
    """A new island; `max_leases` > 1 lets it hold that many leases at once (one by default)."""
    r = client.post("/v1/islands", json={"name": name, "capabilities": {"max_leases": max_leases}}, headers=J)
    assert r.status_code == 201, r.text
    body = r.json()
    return body["island_id"], {"Authorization": f"Bearer {body['token']}"}


def lease(client: TestClient, island_id: int, headers: dict[str, str], *, wait: float = 0) -> dict[str, Any] | None:
    """A lease, or None when there is no work; `wait` > 0 long-polls (e.g. across the apply of a round)."""
    r = client.post(f"/v1/islands/{island_id}/lease", params={"wait": wait} if wait else None, headers=headers)
    if r.status_code == 204:
        return None
    assert r.status_code == 200, r.text
    return r.json()


def train_lease(client: TestClient, lease_body: dict[str, Any], headers: dict[str, str]) -> dict[str, torch.Tensor]:
    """Do what an island does: fetch modules, take a few SGD steps on the shard range, return the upload."""
    cfg = ModelConfig.from_dict(lease_body["model"])
    weights = []
    for m in lease_body["modules"]:
        r = client.get(f"/v1/modules/{m['module_id']}/weights?version={m['version']}", headers=headers)
        assert r.status_code == 200, r.text
        weights.append(decode(r.content))
    model = build_path(cfg, weights)
    tok = client.get(f"/v1/shards/{lease_body['shard']['shard_id']}/tokens", headers=headers)
    tokens = torch.from_numpy(np.frombuffer(tok.content, dtype="<u2").astype(np.int64))
    chunk = tokens[lease_body["token_start"] : lease_body["token_end"]]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(lease_body["inner_steps"]):
        x = chunk[: cfg.seq_len].view(1, -1)
        y = chunk[1 : cfg.seq_len + 1].view(1, -1)
        opt.zero_grad()
        model.loss(x, y).backward()
        opt.step()
    trained = model.state_dict()
    grads: dict[str, torch.Tensor] = {}
    for m, base in zip(lease_body["modules"], weights, strict=True):
        g = pseudo_gradient(base, {k: trained[k] for k in base})
        grads.update({f"{m['level_name']}/{k}": v for k, v in g.items()})
    return grads


def upload(
    client: TestClient,
    lease_body: dict[str, Any],
    headers: dict[str, str],
    payload: bytes | dict[str, torch.Tensor],
    *,
    round_: int | None = None,
    tokens: int = 32,
    loss: float = 5.0,
    next_lease: bool = False,
    overlap: bool = False,
    rebased_at: int | str | None = None,
) -> Any:
    body = encode(payload) if isinstance(payload, dict) else payload
    h = {
        **headers,
        "X-Dipaco-Round": str(lease_body["round"] if round_ is None else round_),
        "X-Dipaco-Tokens": str(tokens),
        "X-Dipaco-Train-Loss": str(loss),
        "Content-Type": "application/octet-stream",
        **({} if rebased_at is None else {"X-Dipaco-Rebased-At": str(rebased_at)}),
    }
    params = {"next_lease": "true", **({"overlap": "true"} if overlap else {})} if next_lease else None
    return client.post(f"/v1/leases/{lease_body['lease_id']}/outer-gradients", content=body, headers=h, params=params)


@contextmanager
def served(settings: Settings, clock: FakeClock) -> Iterator[str]:
    """The coordinator app under uvicorn (httptools, uvloop when installed) on a thread; its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(settings, clock=clock), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def wait_applied(client: TestClient, run_id: int, *, rounds: int = 1, timeout_s: float = 30.0) -> dict[str, Any]:
    """Wait until `rounds` rounds of the run are applied: a round that closes is applied by the apply executors
    in the background, after the upload that closed it has been answered. Returns the run."""
    deadline = time.monotonic() + timeout_s
    while True:
        run: dict[str, Any] = client.get(f"/v1/runs/{run_id}", headers=A).json()
        if run["current_round"] >= rounds or run["status"] == "finished":
            return run
        assert time.monotonic() < deadline, f"run {run_id}: {run['current_round']} of {rounds} round(s) applied"
        time.sleep(0.02)


def eventually(read: Callable[[], T], ok: Callable[[T], bool], *, timeout_s: float = 10.0) -> T:
    """`read()` until `ok` holds of its result (things an apply executor does after its commit, e.g. counters)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = read()
        if ok(value) or time.monotonic() > deadline:
            return value
        time.sleep(0.02)


def app_executor(client: TestClient, clock: FakeClock, *, name: str = "test-0", handed: bool = False) -> ApplyExecutor:
    """An apply executor as the app runs one: its commits wake the lease requests of this process; `handed`: it
    takes up the steps the app's uploads claim for it (as the app's first executor; name it `closer.claimer`)."""
    state = client.app.state.dipaco  # type: ignore[attr-defined]
    return ApplyExecutor(
        sessions=state.sessions,
        blobs=state.blobs,
        clock=clock,
        name=name,
        on_step=lambda done: state.closer.stepped(done, now=clock()),
        handed=state.closer.take_handed if handed else None,
    )


def closed_round(client: TestClient, *, name: str = "steps", **overrides: Any) -> dict[str, Any]:
    """A run whose round 0 every path has uploaded to, on an app with no executor (`no_executors`): `closing`,
    its module steps waiting for an apply executor. Returns the run."""
    run = create_running_run(client, name=name, **overrides)
    for p in range(run["num_paths"]):
        island_id, h = join(client, f"island-{p}")
        body = lease(client, island_id, h)
        assert body is not None
        assert upload(client, body, h, train_lease(client, body, h)).status_code == 200
    rounds = client.get(f"/v1/runs/{run['id']}/rounds", headers=A).json()["data"]
    assert rounds[0]["status"] == "closing"  # nobody applies it here
    return run


def module_versions(client: TestClient) -> dict[int, list[int]]:
    """Module id -> the versions in its history (`module_versions` rows)."""
    state = client.app.state.dipaco  # type: ignore[attr-defined]
    with state.sessions() as session:
        rows = session.execute(select(ModuleVersion.module_id, ModuleVersion.version)).all()
    out: dict[int, list[int]] = {}
    for module_id, version in rows:
        out.setdefault(module_id, []).append(version)
    return {k: sorted(v) for k, v in out.items()}
