"""Validating an outer-gradient upload before anything is written: its safetensors header, the layout of the
run's codec, finite values, and each module's L2 norm (for the robust aggregation of `modules.outer`).

Layouts (`modules.codec.encode_grad`; a payload without `dipaco.codec` metadata, from plain `encode`, is fp32):
  fp32  every tensor of the path's modules, F32, its shape;
  bf16  the same tensors as BF16;
  int8  the same tensors as I8, and one F32 tensor `::scales` holding every tensor's block scales (sorted-name
        order, `ceil(numel / block_size)` each), which must be finite and >= 0 (0 for an all-zero block).
Sparse rows (runs with `sparse_rows`, and only those): the embed level's `tok_emb.weight` is (k, d) in the
codec's dtype, 1 <= k <= vocab, next to `<name>::rows` (I64, (k,)) whose ids are strictly increasing and in
[0, vocab); its norm is the norm of the rows sent (the others count as zeros).
The header is capped before it is read and every field is type-checked; the values are read in place from the
memory-mapped file, one tensor at a time, never copied whole.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path as FilePath

import numpy as np
from safetensors import SafetensorError, safe_open

from coordinator.errors import Invalid
from coordinator.schemas import GRAD_KEY_SEP
from modules import CodecError, Layout, ModelConfig, level_param_shapes
from modules.codec import ROWS_DTYPE, SCALES_NAME, int8_scale_spans, payload_codec, read_header, read_metadata
from modules.sparse_rows import SPARSE_PARAM, is_rows, rows_name

MAX_HEADER_BYTES = 1 << 16
"""Least cap on an upload's safetensors header; the cap is 512 bytes per expected tensor when that is more (a
real header takes ~100 bytes a tensor). The header is JSON parsed in memory: a 32 MiB one cost ~190 MB."""
CHUNK = 1 << 20
"""Values converted at a time when a tensor is not read as float32 directly (bf16, int8, float32 overflow)."""
_DTYPES = {"fp32": ("F32", 4), "bf16": ("BF16", 2), "int8": ("I8", 1)}
"""Codec -> (safetensors dtype of the gradient tensors, bytes per value)."""


@dataclass(frozen=True, slots=True)
class Payload:
    """A validated upload: where each level's tensors are, each level's L2 norm, and the codec it came in."""

    prefixes: dict[int, str]
    """level index -> tensor-name prefix."""
    norms: dict[int, float | None]
    """level index -> L2 norm of that module's (decoded) outer gradient; None until measured (direct uploads)."""
    codec: str


@dataclass(frozen=True, slots=True)
class _Entry:
    dtype: str
    shape: tuple[int, ...]
    level: int | None
    """The module (level index) the tensor belongs to; None for int8 scales and the row ids of sparse rows."""


@dataclass(frozen=True, slots=True)
class Header:
    """A payload's checked safetensors header: what each tensor is and where its bytes are."""

    prefixes: dict[int, str]
    expected: dict[str, _Entry]
    offsets: dict[str, tuple[int, int]]
    data_start: int
    codec: str
    block_size: int


def header_cap(cfg: ModelConfig, layout: Layout, levels: dict[int, tuple[int, str]]) -> int:
    """Largest safetensors header accepted for an upload of these levels."""
    tensors = sum(len(level_param_shapes(cfg, layout, level)) for level in levels)
    return max(MAX_HEADER_BYTES, 512 * (tensors + 1))


def validated_header(
    head: bytes,
    size: int,
    cfg: ModelConfig,
    layout: Layout,
    levels: dict[int, tuple[int, str]],
    *,
    codec: str,
    sparse_rows: bool = False,
) -> Header:
    """Check a payload's first bytes (the 8-byte length and the header, `head`) and its total `size` against the
    path's modules, the run's `codec` and `sparse_rows`: names, dtypes, shapes, offsets, every field's type (422
    otherwise)."""
    prefixes = {level: f"{name}{GRAD_KEY_SEP}" for level, (_, name) in levels.items()}
    shapes = {
        f"{prefixes[level]}{param}": (level, shape)
        for level in levels
        for param, shape in level_param_shapes(cfg, layout, level).items()
    }
    try:
        header = read_header(head)
        sent, block_size = payload_codec(read_metadata(head))
    except CodecError as exc:
        raise Invalid(f"outer-gradient payload: {exc}") from exc
    if sent != codec:
        raise Invalid(f"outer-gradient payload is encoded with {sent}; this run's codec is {codec}")
    sparse = _sparse_name(layout, prefixes) if sparse_rows else None
    if sparse is None:
        extra = sorted(name for name in header if is_rows(name))
        if extra:
            raise Invalid(f"tensor {extra[0]!r}: this run does not take sparse rows (its sparse_rows is false)")
    else:
        level, shape = shapes[sparse]
        shapes[sparse] = (level, (_sent_rows(header, sparse, vocab=shape[0]), *shape[1:]))
    expected = _expected(shapes, codec, block_size)
    if sparse is not None:
        expected[rows_name(sparse)] = _Entry(dtype=ROWS_DTYPE, shape=shapes[sparse][1][:1], level=None)
    unknown = sorted(set(header) - set(expected))
    if unknown:
        raise Invalid(
            f"unknown tensor {unknown[0]!r} in outer-gradient payload; expected names like {next(iter(expected))!r}"
        )
    missing = sorted(set(expected) - set(header))
    if missing:
        raise Invalid(f"outer-gradient payload is missing {len(missing)} tensor(s), e.g. {missing[0]!r}")
    offsets = {name: _tensor_offsets(name, info, expected[name]) for name, info in header.items()}
    data_start = len(head)
    data_end = max((end for _, end in offsets.values()), default=0)
    if data_start + data_end != size:
        raise Invalid(
            f"outer-gradient payload: invalid safetensors payload: {size} bytes, "
            f"the header describes {data_start + data_end}"
        )
    return Header(
        prefixes=prefixes,
        expected=expected,
        offsets=offsets,
        data_start=data_start,
        codec=codec,
        block_size=block_size,
    )


def header_length(first8: bytes, *, cap: int) -> int:
    """The header length a payload's first 8 bytes announce (at most `cap`: a longer one is refused unread)."""
    n = int.from_bytes(first8, "little") if len(first8) == 8 else 0
    if n > cap:
        raise Invalid(f"outer-gradient payload: safetensors header of {n} bytes is over the {cap}-byte cap")
    return n


def validated_payload(
    body: FilePath,
    cfg: ModelConfig,
    layout: Layout,
    levels: dict[int, tuple[int, str]],
    *,
    codec: str,
    sparse_rows: bool = False,
) -> Payload:
    """Check the file against the path's modules, the run's `codec` and `sparse_rows`; measure each module's norm
    (422 with a message naming the problem otherwise)."""
    head = _read_head(body, cap=header_cap(cfg, layout, levels))
    checked = validated_header(head, body.stat().st_size, cfg, layout, levels, codec=codec, sparse_rows=sparse_rows)
    try:
        with safe_open(str(body), framework="pt"):
            pass  # safetensors' own checks of the layout (offsets contiguous, covering the data, no overlap)
    except SafetensorError as exc:
        raise Invalid(f"outer-gradient payload: invalid safetensors payload: {exc}") from exc
    _check_row_ids(body, checked.data_start, checked.offsets, vocab=cfg.vocab_size)
    squares = _sums_of_squares(
        body, checked.data_start, checked.offsets, checked.expected, codec=codec, block_size=checked.block_size
    )
    norms = dict.fromkeys(checked.prefixes, 0.0)
    for name, total in squares.items():
        level = checked.expected[name].level
        if level is not None:
            norms[level] += total
    return Payload(prefixes=checked.prefixes, norms={lv: math.sqrt(t) for lv, t in norms.items()}, codec=codec)


def _sparse_name(layout: Layout, prefixes: dict[int, str]) -> str | None:
    """The payload name of the tensor sent as rows: the embed level's token embedding (None: not on this path)."""
    for level, prefix in prefixes.items():
        if layout.levels[level].kind == "embed":
            return f"{prefix}{SPARSE_PARAM}"
    return None


def _sent_rows(header: dict[str, dict[str, object]], name: str, *, vocab: int) -> int:
    """k, the number of rows of `name` sent, from its `::rows` entry's shape (its dtype and offsets are checked
    with the other entries)."""
    ids = rows_name(name)
    info = header.get(ids)
    if info is None:
        raise Invalid(f"outer-gradient payload is missing {ids!r}: this run sends {name!r} as sparse rows")
    raw = info.get("shape") if isinstance(info, dict) else None
    if not (isinstance(raw, list) and len(raw) == 1 and _is_int(raw[0]) and 1 <= raw[0] <= vocab):
        raise Invalid(f"tensor {ids!r} has shape {raw!r}, expected [k] with 1 <= k <= {vocab} (the vocabulary)")
    return int(raw[0])


def _check_row_ids(body: FilePath, data_start: int, offsets: dict[str, tuple[int, int]], *, vocab: int) -> None:
    """The row ids of sparse rows are strictly increasing (sorted, no duplicate) and within [0, vocab)."""
    names = [name for name in offsets if is_rows(name)]
    if not names:
        return
    data = np.memmap(body, dtype=np.uint8, mode="r")
    for name in names:
        start, end = offsets[name]
        ids = data[data_start + start : data_start + end].view("<i8")
        outside = np.flatnonzero((ids < 0) | (ids >= vocab))
        if outside.size:
            i = int(outside[0])
            raise Invalid(f"tensor {name!r}: row id {int(ids[i])} at {i} is outside the vocabulary [0, {vocab})")
        unsorted = np.flatnonzero(np.diff(ids) <= 0)
        if unsorted.size:
            i = int(unsorted[0]) + 1
            raise Invalid(
                f"tensor {name!r}: row ids must be strictly increasing (sorted, no duplicate); "
                f"{int(ids[i])} at {i} follows {int(ids[i - 1])}"
            )


def _read_head(body: FilePath, *, cap: int) -> bytes:
    """The first 8 bytes and the header (at most `cap` bytes of it: a longer one is refused unread)."""
    size = body.stat().st_size
    with body.open("rb") as f:
        head = f.read(8)
        n = header_length(head, cap=cap)
        return head + (f.read(min(n, size - 8)) if len(head) == 8 else b"")


def _expected(shapes: dict[str, tuple[int, tuple[int, ...]]], codec: str, block_size: int) -> dict[str, _Entry]:
    dtype = _DTYPES[codec][0]
    expected = {name: _Entry(dtype=dtype, shape=shape, level=level) for name, (level, shape) in shapes.items()}
    if codec == "int8":
        spans = int8_scale_spans({name: shape for name, (_, shape) in shapes.items()}, block_size)
        total = sum(count for _, count in spans.values())
        expected[SCALES_NAME] = _Entry(dtype="F32", shape=(total,), level=None)
    return expected


_ITEMSIZE = {"I64": 8, "F32": 4, "BF16": 2, "I8": 1}


def _tensor_offsets(name: str, info: object, entry: _Entry) -> tuple[int, int]:
    """A header entry's (start, end) within the data section, after checking every field's type and value."""
    if not isinstance(info, dict):
        raise Invalid(f"tensor {name!r} has no valid entry in the safetensors header")
    raw_shape = info.get("shape")
    if not isinstance(raw_shape, list) or not all(_is_int(d) and d >= 0 for d in raw_shape):
        raise Invalid(f"tensor {name!r} has no valid shape in the safetensors header")
    dtype = info.get("dtype")
    if dtype != entry.dtype:
        raise Invalid(f"tensor {name!r} has dtype {dtype}, expected {entry.dtype}")
    if tuple(raw_shape) != entry.shape:
        raise Invalid(f"tensor {name!r} has shape {raw_shape}, expected {list(entry.shape)}")
    offsets = info.get("data_offsets")
    if not (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(_is_int(o) and o >= 0 for o in offsets)
        and offsets[1] - offsets[0] == _ITEMSIZE[entry.dtype] * math.prod(entry.shape)
    ):
        raise Invalid(f"tensor {name!r} has invalid data_offsets {offsets!r}")
    return int(offsets[0]), int(offsets[1])


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _sums_of_squares(
    body: FilePath,
    data_start: int,
    offsets: dict[str, tuple[int, int]],
    expected: dict[str, _Entry],
    *,
    codec: str,
    block_size: int,
) -> dict[str, float]:
    """Each gradient tensor's sum of squared (decoded) values; refuses (422) NaN/Inf values and bad int8 scales.

    fp32 tensors are read as float32 views of the memory-mapped file and squared with one BLAS dot product; a
    non-finite dot means a NaN/Inf value, or finite values so large that float32 overflowed (e.g. 3.4e38): those
    are counted exactly, and only in the second case is the sum redone in float64, a chunk at a time. bf16
    values are widened to float32 a chunk at a time; int8 values are summed per block, times the block's scale.
    """
    data = np.memmap(body, dtype=np.uint8, mode="r")  # unmapped when the last view goes, on return

    def raw(name: str) -> np.ndarray:
        start, end = offsets[name]
        return data[data_start + start : data_start + end]

    sums: dict[str, float] = {}
    scales: np.ndarray | None = None
    spans: dict[str, tuple[int, int]] = {}
    if codec == "int8":
        scales = raw(SCALES_NAME).view("<f4")
        bad = np.flatnonzero(~np.isfinite(scales) | (scales < 0))
        if bad.size:
            raise Invalid(
                f"int8 payload: block scale {int(bad[0])} is {float(scales[bad[0]])!r}; scales must be finite and >= 0"
            )
        spans = int8_scale_spans({n: e.shape for n, e in expected.items() if e.level is not None}, block_size)
    with np.errstate(over="ignore", invalid="ignore"):  # overflowing products are expected here, not warnings
        for name, entry in expected.items():
            if entry.level is None:
                continue
            if codec == "fp32":
                sums[name] = _f32_squares(name, raw(name).view("<f4"))
            elif codec == "bf16":
                sums[name] = _f32_squares(name, raw(name).view("<u2"), widen=True)
            else:
                assert scales is not None  # int8
                start, count = spans[name]
                sums[name] = _int8_squares(raw(name).view("i1"), scales[start : start + count], block_size)
    return sums


def _chunks(values: np.ndarray, *, widen: bool) -> Iterator[np.ndarray]:
    for i in range(0, values.size, CHUNK):
        chunk = values[i : i + CHUNK]
        # bf16 is the top half of a float32: shifting its bits up 16 gives the same number exactly
        yield (chunk.astype(np.uint32) << 16).view(np.float32) if widen else chunk


def _f32_squares(name: str, values: np.ndarray, *, widen: bool = False) -> float:
    if not widen:
        total = float(np.dot(values, values))
        if math.isfinite(total):
            return total
    total = 0.0
    for chunk in _chunks(values, widen=widen):
        finite = np.isfinite(chunk)
        if not finite.all():
            bad = sum(int(np.count_nonzero(~np.isfinite(c))) for c in _chunks(values, widen=widen))
            raise Invalid(f"tensor {name!r} has {bad} non-finite value(s) (NaN/Inf)")
        wide = chunk.astype(np.float64)
        total += float(np.dot(wide, wide))
    return total


def _int8_squares(q: np.ndarray, scales: np.ndarray, block_size: int) -> float:
    """sum_b scale_b^2 * sum_{i in b} q_i^2, a few thousand blocks at a time."""
    total = 0.0
    step = max(1, CHUNK // block_size) * block_size
    for i in range(0, q.size, step):
        chunk = q[i : i + step].astype(np.int64)
        blocks = -(-chunk.size // block_size)
        padded = np.zeros(blocks * block_size, dtype=np.int64)
        padded[: chunk.size] = chunk
        per_block = (padded.reshape(blocks, block_size) ** 2).sum(axis=1)
        s = scales[i // block_size : i // block_size + blocks].astype(np.float64)
        total += float(np.dot(per_block.astype(np.float64), s * s))
    return total
