"""Codecs on the wire: a run's islands upload their outer gradients as fp32, bf16 or int8; the coordinator checks
that codec's layout, stores the upload as received and the apply decodes it."""

from __future__ import annotations

import json
import struct
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from modules import OuterConfig, RoundAccumulator, decode, decode_grad, encode, encode_grad, grad_norm
from modules.codec import SCALES_NAME
from tests.coordinator.helpers import A, create_running_run, join, lease, train_lease, upload, wait_applied


def _one_lease(client: TestClient, name: str) -> tuple[dict[str, Any], dict[str, str], dict[str, torch.Tensor]]:
    island_id, h = join(client, name)
    body = lease(client, island_id, h)
    assert body is not None
    return body, h, train_lease(client, body, h)


@pytest.mark.parametrize("codec", ["bf16", "int8"])
def test_a_round_in_a_compressed_codec_is_decoded_by_the_apply(client: TestClient, codec: str) -> None:
    run = create_running_run(client, name=f"codec-{codec}", codec=codec, num_rounds=2)
    assert run["config"]["codec"] == codec
    modules = {m["id"]: m for m in client.get(f"/v1/modules?run_id={run['id']}", headers=A).json()["data"]}
    base = {mid: decode(client.get(f"/v1/modules/{mid}/weights", headers=A).content) for mid in modules}
    sent: dict[int, list[dict[str, torch.Tensor]]] = {mid: [] for mid in modules}
    for p in range(run["num_paths"]):
        body, h, grads = _one_lease(client, f"{codec}-{p}")
        assert body["codec"] == codec
        payload = encode_grad(grads, codec)
        r = upload(client, body, h, payload)
        assert r.status_code == 200, r.text
        decoded = decode_grad(payload)
        for m in body["modules"]:
            prefix = f"{m['level_name']}/"
            sent[m["module_id"]].append({k[len(prefix) :]: v for k, v in decoded.items() if k.startswith(prefix)})
    wait_applied(client, run["id"])
    contributions = client.get(f"/v1/contributions?run_id={run['id']}", headers=A).json()["data"]
    assert {c["codec"] for c in contributions} == {codec}
    fp32_bytes = 4 * sum(t.numel() for t in grads.values())
    for c in contributions:
        assert c["upload_bytes"] < (0.3 if codec == "int8" else 0.52) * fp32_bytes
    # each module: the run's outer step over the decoded uploads, and the norms measured on the decoded values
    for mid in modules:
        acc = RoundAccumulator()
        for g in sent[mid]:
            acc.add(g)
        want, _ = acc.finish(base[mid], None, OuterConfig())
        got = decode(client.get(f"/v1/modules/{mid}/weights", headers=A).content)
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-6)
    norms = sorted(part["norm"] for c in contributions for part in c["modules"])
    want_norms = sorted(grad_norm(g) for gs in sent.values() for g in gs)
    assert norms == pytest.approx(want_norms, rel=1e-5)


def _raw(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    return st_save({k: v.contiguous() for k, v in tensors.items()}, metadata=metadata)


def test_layouts_that_do_not_match_the_runs_codec_are_refused_and_change_nothing(client: TestClient) -> None:
    run = create_running_run(client, name="int8-run", codec="int8")
    body, h, grads = _one_lease(client, "int8-island")
    good = encode_grad(grads, "int8")
    tensors = st_load(good)
    scales = tensors[SCALES_NAME]
    meta = {"dipaco.codec": "int8", "dipaco.block_size": "256"}
    first = next(k for k in tensors if k != SCALES_NAME)
    cases: list[tuple[str, bytes, str]] = [
        ("fp32 in an int8 run", encode(grads), "outer-gradient payload is encoded with fp32; this run's codec is int8"),
        ("bf16 in an int8 run", encode_grad(grads, "bf16"), "is encoded with bf16; this run's codec is int8"),
        ("no scales", _raw({k: v for k, v in tensors.items() if k != SCALES_NAME}, meta), "missing 1 tensor(s)"),
        ("too few scales", _raw({**tensors, SCALES_NAME: scales[:-1]}, meta), "has shape"),
        ("negative scale", _raw({**tensors, SCALES_NAME: -scales}, meta), "scales must be finite and >= 0"),
        ("nan scale", _raw({**tensors, SCALES_NAME: scales * float("nan")}, meta), "scales must be finite and >= 0"),
        ("float values", _raw({**tensors, first: tensors[first].float()}, meta), "expected I8"),
        ("bad block size", _raw(tensors, {**meta, "dipaco.block_size": "0"}), "int8 block size must be in"),
        ("unknown codec", _raw(tensors, {**meta, "dipaco.codec": "fp8"}), "unknown gradient codec 'fp8'"),
    ]
    for label, payload, detail in cases:
        r = upload(client, body, h, payload)
        assert r.status_code == 422, (label, r.status_code, r.text)
        assert detail in r.json()["detail"], (label, r.json()["detail"])
    assert client.get(f"/v1/contributions?run_id={run['id']}", headers=A).json()["count"] == 0
    assert upload(client, body, h, good).status_code == 200


def test_an_fp32_run_takes_plain_and_codec_tagged_fp32_but_not_int8(client: TestClient) -> None:
    create_running_run(client, name="fp32-run")
    body, h, grads = _one_lease(client, "fp32-island")
    r = upload(client, body, h, encode_grad(grads, "int8"))
    assert r.status_code == 422 and "encoded with int8; this run's codec is fp32" in r.json()["detail"]
    assert upload(client, body, h, encode_grad(grads, "fp32")).status_code == 200
    other, oh, other_grads = _one_lease(client, "fp32-legacy")
    assert upload(client, other, oh, encode(other_grads)).status_code == 200  # no codec metadata: fp32


def test_an_oversized_int8_header_claim_is_refused_before_it_is_read(client: TestClient) -> None:
    create_running_run(client, name="int8-header", codec="int8")
    body, h, _ = _one_lease(client, "header-island")
    raw = json.dumps({"__metadata__": {"dipaco.codec": "int8"}}).encode()
    r = upload(client, body, h, struct.pack("<Q", 10**8) + raw)
    assert r.status_code == 422 and "over the" in r.json()["detail"]
