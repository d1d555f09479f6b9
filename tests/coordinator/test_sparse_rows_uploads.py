"""The run field `sparse_rows`: refused with tied embeddings, told to the islands in the lease, and every bad
sparse upload gets a specific 422 and changes nothing (`coordinator.services.payloads`)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient

from coordinator.settings import Settings
from tests.coordinator.helpers import TINY_RUN, A, create_running_run, join, lease, train_lease, upload
from tests.coordinator.test_bad_uploads import snapshot

EMB = "embed/tok_emb.weight"
ROWS = "embed/tok_emb.weight::rows"


def sparse(good: dict[str, torch.Tensor], ids: list[int], *, values: torch.Tensor | None = None) -> dict[str, Any]:
    """`good` with the embedding sent as the rows `ids` (fp32, plain safetensors as the helpers upload)."""
    rows = torch.tensor(ids, dtype=torch.int64)
    sent = values if values is not None else good[EMB][rows.clamp(0, good[EMB].shape[0] - 1)]
    return {**good, EMB: sent, ROWS: rows}


def test_sparse_rows_are_refused_with_tied_embeddings(client: TestClient) -> None:
    spec = {**TINY_RUN, "model": {**TINY_RUN["model"], "tie_embeddings": True}, "sparse_rows": True}
    r = client.post("/v1/runs", json=spec, headers=A)
    assert r.status_code == 422, r.text
    assert r.json()["detail"] == (
        "sparse_rows needs untied embeddings: with tie_embeddings the token embedding is also the LM head, whose "
        "every row gets gradient from the softmax (set model.tie_embeddings to false, or sparse_rows to false)"
    )
    assert client.get("/v1/runs", headers=A).json()["count"] == 0


def test_bad_sparse_uploads_are_refused_and_change_nothing(
    value_checks: str, client: TestClient, settings: Settings
) -> None:
    run = create_running_run(client, sparse_rows=True)
    assert run["config"]["sparse_rows"] is True
    island_id, h = join(client, "a")
    lb = lease(client, island_id, h)
    assert lb is not None and lb["sparse_rows"] is True
    vocab = lb["model"]["vocab_size"]
    good = train_lease(client, lb, h)
    before = snapshot(settings)
    d = good[EMB].shape[1]
    cases: list[tuple[str, dict[str, Any], str]] = [
        ("dense embedding", good, f"outer-gradient payload is missing {ROWS!r}: this run sends {EMB!r} as sparse rows"),
        ("row past the vocabulary", sparse(good, [1, 5, vocab]), f"row id {vocab} at 2 is outside the vocabulary"),
        ("negative row", sparse(good, [-1, 5, 9]), f"tensor {ROWS!r}: row id -1 at 0 is outside the vocabulary"),
        ("unsorted", sparse(good, [5, 1, 9]), "row ids must be strictly increasing (sorted, no duplicate); 1 at 1"),
        ("duplicate", sparse(good, [1, 5, 5]), "row ids must be strictly increasing (sorted, no duplicate); 5 at 2"),
        (
            "more rows than the vocabulary",
            sparse(good, list(range(vocab + 1)), values=torch.zeros(vocab + 1, d)),
            f"tensor {ROWS!r} has shape [{vocab + 1}], expected [k] with 1 <= k <= {vocab} (the vocabulary)",
        ),
        (
            "no row",
            sparse(good, [], values=torch.zeros(0, d)),
            f"tensor {ROWS!r} has shape [0], expected [k] with 1 <= k <= {vocab}",
        ),
        ("rows and values disagree", sparse(good, [1, 2], values=torch.zeros(3, d)), f"tensor {EMB!r} has shape"),
        ("row ids not int64", {**sparse(good, [1, 2]), ROWS: torch.tensor([1, 2], dtype=torch.int32)}, "dtype I32"),
    ]
    for label, payload, detail in cases:
        r = upload(client, lb, h, payload)
        assert r.status_code == 422, (label, r.status_code, r.text)
        assert detail in r.json()["detail"], (label, r.json()["detail"])
        assert snapshot(settings) == before, label
    ok = sparse(good, [3, 7, 200])
    r = upload(client, lb, h, ok)
    assert r.status_code == 200, r.text
    (contribution,) = client.get("/v1/contributions", params={"run_id": run["id"]}, headers=A).json()["data"]
    # the module's norm is the norm of the rows sent (and the embed level's other tensors)
    want = math.sqrt(sum(float((t.double() ** 2).sum()) for k, t in ok.items() if k.startswith("embed/") and k != ROWS))
    assert contribution["modules"][0]["norm"] == pytest.approx(want, rel=1e-6)


def test_row_ids_are_refused_on_a_dense_run(client: TestClient, settings: Settings) -> None:
    create_running_run(client)
    island_id, h = join(client, "a")
    lb = lease(client, island_id, h)
    assert lb is not None and lb["sparse_rows"] is False
    good = train_lease(client, lb, h)
    before = snapshot(settings)
    r = upload(client, lb, h, sparse(good, [1, 2]))
    assert r.status_code == 422
    assert r.json()["detail"] == f"tensor {ROWS!r}: this run does not take sparse rows (its sparse_rows is false)"
    assert snapshot(settings) == before
    assert upload(client, lb, h, good).status_code == 200
