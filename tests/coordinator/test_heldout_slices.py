"""Held-out slices: a path's held-out tokens registered next to its shard, carried by its leases, scored by the
island at the lease's start weights and recorded with the upload (history, contributions); every bad input gets a
clear error and changes nothing."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
from fastapi.testclient import TestClient

from tests.coordinator.helpers import TINY_RUN, A, create_running_run, join, lease, train_lease, upload


def _slice(n: int, *, seed: int = 1, high: int = 256) -> bytes:
    return np.random.default_rng(seed).integers(0, high, n).astype("<u2").tobytes()


def _register(client: TestClient, run_id: int, path: int, body: bytes, *, headers: dict[str, str] = A) -> Any:
    return client.post(f"/v1/runs/{run_id}/shards/{path}/heldout?num_documents=3", content=body, headers=headers)


def test_a_registered_slice_reaches_leases_and_its_loss_the_history(client: TestClient) -> None:
    run = create_running_run(client, name="heldout", heldout_tokens=40)
    body = _slice(100)
    r = _register(client, run["id"], 0, body)
    assert r.status_code == 201, r.text
    shard = r.json()
    assert shard["heldout_hash"] == hashlib.sha256(body).hexdigest()
    assert (shard["heldout_tokens"], shard["heldout_documents"]) == (100, 3)

    island_id, h = join(client, "scorer", max_leases=2)
    leases = {lb["path_index"]: lb for lb in (lease(client, island_id, h), lease(client, island_id, h)) if lb}
    assert set(leases) == {0, 1}
    with_slice, without = leases[0], leases[1]
    assert without["heldout"] is None  # path 1 has no slice
    assert with_slice["heldout"]["tokens_hash"] == shard["heldout_hash"]
    assert with_slice["heldout"]["score_tokens"] == 40  # the run's heldout_tokens, under the slice's 100
    got = client.get(f"/v1/shards/{with_slice['heldout']['shard_id']}/heldout", headers=h)
    assert got.status_code == 200 and got.content == body

    for path, lb in leases.items():
        headers = {**h, "X-Dipaco-Heldout-Loss": "4.25"} if path == 0 else h
        r = upload(client, lb, headers, train_lease(client, lb, h))
        assert r.status_code == 200, r.text
        assert r.json()["heldout_loss"] == (4.25 if path == 0 else None)
    history = client.get(f"/v1/runs/{run['id']}/history", headers=A).json()
    losses = {p["path_index"]: p["heldout_loss"] for p in history["data"][0]["losses"]}
    assert losses == {0: 4.25, 1: None}
    listed = client.get(f"/v1/contributions?run_id={run['id']}", headers=A).json()["data"]
    assert sorted((c["path_index"], c["heldout_loss"]) for c in listed) == [(0, 4.25), (1, None)]


def test_bad_slices_are_refused_and_change_nothing(client: TestClient) -> None:
    run = create_running_run(client, name="bad-slices")
    rid = run["id"]
    seq_len = TINY_RUN["model"]["seq_len"]
    cases = [
        (_slice(100)[:-1], 422, "2-byte (uint16) tokens"),
        (_slice(seq_len), 422, f"at least one window of seq_len + 1 = {seq_len + 1}"),
        (_slice(100, high=60_000), 422, "the model's vocabulary is 257"),
    ]
    for body, status, text in cases:
        r = _register(client, rid, 0, body)
        assert r.status_code == status and text in r.json()["detail"], r.text
    r = _register(client, rid, 9, _slice(100))
    assert r.status_code == 404 and r.json()["detail"] == f"path 9 does not exist: run {rid} has paths 0..3"
    island_id, h = join(client, "not-admin")
    r = _register(client, rid, 0, _slice(100), headers=h)
    assert r.status_code == 403
    # nothing was stored: the path's leases carry no slice
    lb = lease(client, island_id, h)
    assert lb is not None and lb["heldout"] is None
    assert client.get(f"/v1/shards/{lb['shard']['shard_id']}/heldout", headers=h).status_code == 404
    # bad held-out losses on the upload
    for value in ("nan", "-1", "abc", "inf"):
        r = upload(client, lb, {**h, "X-Dipaco-Heldout-Loss": value}, train_lease(client, lb, h))
        assert r.status_code == 422 and "eld" in r.text.lower(), (value, r.text)


def test_a_slice_before_its_shard_and_a_run_that_keeps_none(client: TestClient) -> None:
    r = client.post("/v1/runs", json={**TINY_RUN, "name": "early"}, headers=A)
    assert r.status_code == 201
    early = r.json()
    r = _register(client, early["id"], 0, _slice(100))
    assert r.status_code == 409 and "register its shard first" in r.json()["detail"]
    none = create_running_run(client, name="keeps-none", heldout_tokens=0)
    r = _register(client, none["id"], 0, _slice(100))
    assert r.status_code == 409 and "keeps no held-out slices" in r.json()["detail"]
    r = client.post("/v1/runs", json={**TINY_RUN, "name": "short", "heldout_tokens": 10}, headers=A)
    assert r.status_code == 422 and "seq_len + 1 = 17" in r.text
