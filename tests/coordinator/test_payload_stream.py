"""`PayloadStream` (the upload's values checked as the bytes arrive) against `validated_payload` (the same checks
on the spooled file): the same norms for every codec and sparse rows however the body is cut into buffers, and
the same 422 message for every bad payload."""

from __future__ import annotations

import json
import math
import random
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from coordinator.errors import Invalid
from coordinator.schemas import GRAD_KEY_SEP
from coordinator.services.payloads import Payload, PayloadStream, validated_payload
from modules import ModelConfig, level_param_shapes, parse_layout
from modules.codec import encode_grad

CFG = ModelConfig(vocab_size=64, seq_len=8, d_model=16, n_layers=2, n_heads=2)
LAYOUT = parse_layout("embed:shared, b0-1:routed2, head:shared", n_layers=2)
LEVELS = {lv: (lv + 1, level.name) for lv, level in enumerate(LAYOUT.levels)}
EMB = f"embed{GRAD_KEY_SEP}tok_emb.weight"


def grads(seed: int = 0, scale: float = 0.01) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        f"{name}{GRAD_KEY_SEP}{param}": torch.randn(shape, generator=gen) * scale
        for lv, (_, name) in LEVELS.items()
        for param, shape in level_param_shapes(CFG, LAYOUT, lv).items()
    }


def body(codec: str, tensors: dict[str, torch.Tensor] | None = None, *, sparse: bool = False) -> bytes:
    rows = {EMB: torch.tensor([1, 4, 9, 33])} if sparse else None
    return encode_grad(tensors if tensors is not None else grads(), codec, block_size=16, rows=rows)  # type: ignore[arg-type]


def streamed(data: bytes, cuts: list[int], *, codec: str, sparse: bool = False) -> Payload:
    stream = PayloadStream(CFG, LAYOUT, LEVELS, codec=codec, sparse_rows=sparse)
    at = 0
    for cut in [*cuts, len(data)]:
        stream.update(data[at:cut])
        at = cut
    return stream.finish(len(data))


def from_file(tmp_path: Path, data: bytes, *, codec: str, sparse: bool = False) -> Payload:
    path = tmp_path / "body.upload"
    path.write_bytes(data)
    return validated_payload(path, CFG, LAYOUT, LEVELS, codec=codec, sparse_rows=sparse)


def cuttings(size: int, seed: int) -> list[list[int]]:
    """Whole; every 1, 3 and 4096 bytes; random cuts."""
    rng = random.Random(seed)
    every = [list(range(step, size, step)) for step in (1, 3, 4096)]
    return [[], *every, sorted(rng.sample(range(1, size), 40))]


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse-rows"])
@pytest.mark.parametrize("codec", ["fp32", "bf16", "int8"])
def test_streamed_norms_equal_the_file_check_however_the_body_is_cut(tmp_path: Path, codec: str, sparse: bool) -> None:
    data = body(codec, sparse=sparse)
    want = from_file(tmp_path, data, codec=codec, sparse=sparse)
    assert all(n is not None and n > 0 for n in want.norms.values())
    for cuts in cuttings(len(data), seed=len(data)):
        got = streamed(data, cuts, codec=codec, sparse=sparse)
        assert got.prefixes == want.prefixes and got.codec == codec
        assert got.norms == pytest.approx(want.norms, rel=1e-6)


def test_finite_values_that_overflow_float32_are_summed_in_float64() -> None:
    tensors = grads()
    tensors[EMB] = torch.full_like(tensors[EMB], 3e38)
    norms = streamed(body("fp32", tensors), [100, 1001], codec="fp32").norms
    assert norms[0] == pytest.approx(math.sqrt(tensors[EMB].numel()) * 3e38, rel=1e-6)


def _nan(codec: str) -> bytes:
    tensors = grads()
    last = sorted(tensors)[-1]
    tensors[last].view(-1)[:3] = float("nan")
    tensors[last].view(-1)[-2:] = float("inf")
    return body(codec, tensors)


def _header(data: bytes) -> tuple[dict[str, object], bytes]:
    n = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def _with_header(header: dict[str, object], rest: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + rest


def _overlapping(data: bytes) -> bytes:
    """Two tensors of the same size pointed at the same bytes (the header's sizes and shapes still agree)."""
    header, rest = _header(data)
    by_size: dict[int, list[str]] = {}
    for name, info in header.items():
        if name != "__metadata__":
            start, end = info["data_offsets"]  # type: ignore[index]
            by_size.setdefault(end - start, []).append(name)
    a, b = next(names for names in by_size.values() if len(names) > 1)[:2]
    header[b] = {**header[b], "data_offsets": header[a]["data_offsets"]}  # type: ignore[dict-item]
    return _with_header(header, rest)


def _bad_scale(data: bytes, value: float) -> bytes:
    header, rest = _header(data)
    start = header["::scales"]["data_offsets"][0]  # type: ignore[index]
    raw = bytearray(rest)
    raw[start + 8 : start + 12] = struct.pack("<f", value)
    return _with_header(header, bytes(raw))


def _unsorted_rows(data: bytes) -> bytes:
    header, rest = _header(data)
    start = header[f"{EMB}::rows"]["data_offsets"][0]  # type: ignore[index]
    raw = bytearray(rest)
    raw[start : start + 16] = struct.pack("<qq", 4, 1)
    return _with_header(header, bytes(raw))


BAD: list[tuple[str, str, Callable[[], bytes], bool]] = [
    ("nan-fp32", "fp32", lambda: _nan("fp32"), False),
    ("nan-bf16", "bf16", lambda: _nan("bf16"), False),
    ("truncated body", "fp32", lambda: body("fp32")[:-5], False),
    ("trailing bytes", "fp32", lambda: body("fp32") + b"\0" * 7, False),
    ("truncated header", "fp32", lambda: body("fp32")[:20], False),
    ("four bytes", "fp32", lambda: b"\1\2\3\4", False),
    ("header over the cap", "fp32", lambda: struct.pack("<Q", 1 << 40) + b"{}", False),
    ("wrong codec", "int8", lambda: body("fp32"), False),
    ("negative scale", "int8", lambda: _bad_scale(body("int8"), -1.0), False),
    ("nan scale", "int8", lambda: _bad_scale(body("int8"), float("nan")), False),
    ("unsorted row ids", "fp32", lambda: _unsorted_rows(body("fp32", sparse=True)), True),
    ("dense embedding for sparse rows", "fp32", lambda: body("fp32"), True),
]


@pytest.mark.parametrize(("case", "codec", "make", "sparse"), BAD, ids=[case for case, *_ in BAD])
def test_a_bad_payload_gets_the_same_422_streamed(
    tmp_path: Path, case: str, codec: str, make: Callable[[], bytes], sparse: bool
) -> None:
    data = make()
    with pytest.raises(Invalid) as want:
        from_file(tmp_path, data, codec=codec, sparse=sparse)
    for cuts in ([], list(range(7, len(data), 7))):
        with pytest.raises(Invalid) as got:
            streamed(data, cuts, codec=codec, sparse=sparse)
        assert str(got.value) == str(want.value), case


def test_tensors_that_overlap_are_refused_streamed(tmp_path: Path) -> None:
    data = _overlapping(body("fp32"))
    with pytest.raises(Invalid, match="invalid safetensors payload"):
        from_file(tmp_path, data, codec="fp32")
    with pytest.raises(Invalid, match="must follow each other, no gap, no overlap"):
        streamed(data, [50], codec="fp32")
