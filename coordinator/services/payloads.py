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

import logging
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

log = logging.getLogger(__name__)

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
    size: int | None,
    cfg: ModelConfig,
    layout: Layout,
    levels: dict[int, tuple[int, str]],
    *,
    codec: str,
    sparse_rows: bool = False,
) -> Header:
    """Check a payload's first bytes (the 8-byte length and the header, `head`) and its total `size` (None: not
    known yet) against the path's modules, the run's `codec` and `sparse_rows`: names, dtypes, shapes, offsets,
    every field's type (422 otherwise)."""
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
    if size is not None:
        _check_size(data_start, offsets, size)
    return Header(
        prefixes=prefixes,
        expected=expected,
        offsets=offsets,
        data_start=data_start,
        codec=codec,
        block_size=block_size,
    )


def _check_size(data_start: int, offsets: dict[str, tuple[int, int]], size: int) -> None:
    data_end = max((end for _, end in offsets.values()), default=0)
    if data_start + data_end != size:
        raise Invalid(
            f"outer-gradient payload: invalid safetensors payload: {size} bytes, "
            f"the header describes {data_start + data_end}"
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
    return _payload(checked, squares)


def _payload(header: Header, squares: dict[str, float]) -> Payload:
    """The payload with each level's norm, from each gradient tensor's sum of squares."""
    norms = dict.fromkeys(header.prefixes, 0.0)
    for name, total in squares.items():
        level = header.expected[name].level
        if level is not None:
            norms[level] += total
    return Payload(prefixes=header.prefixes, norms={lv: math.sqrt(t) for lv, t in norms.items()}, codec=header.codec)


@dataclass(slots=True)
class _Span:
    """One tensor of a streamed payload: where its bytes are in the body, and what was gathered from them."""

    name: str
    entry: _Entry
    end: int
    """Where its bytes end in the body (tensors tile the data section, so the previous one's end is its start)."""
    carry: bytes = b""
    """The first bytes of a value that the previous buffer cut."""
    squares: float = 0.0
    nonfinite: int = 0
    seen: int = 0
    """Values consumed (int8: where the next one falls in its blocks)."""
    blocks: np.ndarray | None = None
    """int8: each block's sum of squared values (int64, exact)."""
    kept: bytearray | None = None
    """Block scales and row ids: kept whole (small), checked at the end."""


class PayloadStream:
    """`validated_payload` on the bytes of an upload as they arrive, so that the spooled file is never read back.

    `update` takes the body's buffers in order (from the spool thread); `finish` gives the `Payload`, or raises
    the first problem found with the same message `validated_payload` gives it. The header is checked once its
    bytes are in (also that the tensors tile the data section, the safetensors layout rule); then each buffer
    is cut at tensor boundaries and its values squared and checked in place: fp32 and bf16 values one piece at
    a time (a value cut by a buffer boundary is carried over), int8 values into per-block sums of squares that
    meet their block scales at the end. Memory: the header, the scales and row ids, one int64 per int8 block.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        layout: Layout,
        levels: dict[int, tuple[int, str]],
        *,
        codec: str,
        sparse_rows: bool = False,
    ) -> None:
        self.cfg, self.layout, self.levels = cfg, layout, dict(levels)
        self.codec, self.sparse_rows = codec, sparse_rows
        self._cap = header_cap(cfg, layout, levels)
        self._head = bytearray()
        self._head_size: int | None = None
        self._header: Header | None = None
        self._spans: list[_Span] = []
        self._at = 0
        self._pos = 0
        self._error: Invalid | None = None
        self.usable = True
        """False after an unexpected error while checking (logged): the caller reads the file back instead."""

    def checks(self, levels: dict[int, tuple[int, str]], codec: str, sparse_rows: bool) -> bool:
        """Whether this stream checked for these modules, codec and sparse_rows (what the upload checks found)."""
        return (self.levels, self.codec, self.sparse_rows) == (levels, codec, sparse_rows)

    def update(self, buf: bytes | memoryview) -> None:
        """Check the next bytes of the body (never raises: the first problem is kept for `finish`)."""
        if self._error is not None or not self.usable:
            return
        try:
            view = memoryview(buf).cast("B")
            if self._header is None:
                view = self._take_head(view)
            if self._header is not None:
                self._take_data(view)
        except Invalid as exc:
            self._error = exc
        except Exception:  # a bug here must not fail the upload: its file is checked instead
            log.exception("checking an upload while it streams in failed; its spooled file will be checked")
            self.usable = False

    def finish(self, size: int) -> Payload:
        """The checked payload of a body of `size` bytes (422 with the first problem otherwise)."""
        if self._error is not None:
            raise self._error
        if self._header is None:  # the body ended inside its header: the same error as from the file
            self._header = self._checked_header(size)
        header = self._header
        _check_size(header.data_start, header.offsets, size)
        kept = {span.name: span for span in self._spans if span.kept is not None}
        for name, span in kept.items():
            if is_rows(name):
                _check_ids(name, np.frombuffer(span.kept or b"", dtype="<i8"), vocab=self.cfg.vocab_size)
        scales = np.frombuffer(kept[SCALES_NAME].kept or b"", dtype="<f4") if self.codec == "int8" else None
        if scales is not None:
            _check_scales(scales)
        spans = {span.name: span for span in self._spans}
        shapes = {n: e.shape for n, e in header.expected.items() if e.level is not None}
        scale_spans = int8_scale_spans(shapes, header.block_size) if scales is not None else {}
        squares: dict[str, float] = {}
        for name in shapes:  # the file check's order, so the same tensor is named first
            span = spans[name]
            _check_finite(name, span.nonfinite)
            if span.blocks is not None and scales is not None:
                start, count = scale_spans[name]
                squares[name] = _int8_total(span.blocks, scales[start : start + count])
            else:
                squares[name] = span.squares
        return _payload(header, squares)

    def _take_head(self, view: memoryview) -> memoryview:
        if self._head_size is None:
            take = 8 - len(self._head)
            self._head += view[:take]
            view = view[take:]
            if len(self._head) < 8:
                return view
            self._head_size = 8 + header_length(bytes(self._head), cap=self._cap)
        take = self._head_size - len(self._head)
        self._head += view[:take]
        view = view[take:]
        if len(self._head) == self._head_size:
            self._start_data()
        return view

    def _checked_header(self, size: int | None) -> Header:
        return validated_header(
            bytes(self._head), size, self.cfg, self.layout, self.levels, codec=self.codec, sparse_rows=self.sparse_rows
        )

    def _start_data(self) -> None:
        header = self._checked_header(None)
        self._pos = header.data_start
        at = 0
        for name, (start, end) in sorted(header.offsets.items(), key=lambda item: item[1]):
            if start != at:
                raise Invalid(
                    f"outer-gradient payload: invalid safetensors payload: tensor {name!r} starts at byte {start} of "
                    f"the data, the tensors before it end at {at} (they must follow each other, no gap, no overlap)"
                )
            at = end
            entry = header.expected[name]
            span = _Span(name=name, entry=entry, end=header.data_start + end)
            if entry.level is None:
                span.kept = bytearray()
            elif entry.dtype == "I8":
                blocks = -(-math.prod(entry.shape) // header.block_size)
                span.blocks = np.zeros(blocks, dtype=np.int64)
            self._spans.append(span)
        self._header = header

    def _take_data(self, view: memoryview) -> None:
        while view and self._at < len(self._spans):
            span = self._spans[self._at]
            n = min(len(view), span.end - self._pos)
            if n:
                self._piece(span, view[:n])
                self._pos += n
                view = view[n:]
            if self._pos == span.end:
                self._at += 1
        self._pos += len(view)  # past the header's data: `finish` refuses the size

    def _piece(self, span: _Span, piece: memoryview) -> None:
        if span.kept is not None:
            span.kept += piece
            return
        if span.blocks is not None:  # int8
            assert self._header is not None
            q = np.frombuffer(piece, dtype="i1")
            _add_block_squares(span.blocks, q, first=span.seen, block_size=self._header.block_size)
            span.seen += q.size
            return
        width = _ITEMSIZE[span.entry.dtype]
        data: bytes | memoryview = piece
        if span.carry:
            data = span.carry + bytes(piece[: width - len(span.carry)])
            piece = piece[width - len(span.carry) :]
            if len(data) < width:
                span.carry = bytes(data)
                return
            self._values(span, data)
            data = piece
        whole = len(data) // width * width
        span.carry = bytes(data[whole:])
        if whole:
            self._values(span, data[:whole])

    def _values(self, span: _Span, data: bytes | memoryview) -> None:
        widen = span.entry.dtype == "BF16"
        values = np.frombuffer(data, dtype="<u2" if widen else "<f4")
        with np.errstate(over="ignore", invalid="ignore"):
            squares, bad = _float_squares(values, widen=widen)
        span.squares += squares
        span.nonfinite += bad


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
        _check_ids(name, data[data_start + start : data_start + end].view("<i8"), vocab=vocab)


def _check_ids(name: str, ids: np.ndarray, *, vocab: int) -> None:
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
    """Each gradient tensor's sum of squared (decoded) values, read from the memory-mapped file; refuses (422)
    NaN/Inf values and bad int8 scales. fp32 and bf16: `_float_squares`; int8 values are summed per block
    (`_add_block_squares`), times the block's scale squared."""
    data = np.memmap(body, dtype=np.uint8, mode="r")  # unmapped when the last view goes, on return

    def raw(name: str) -> np.ndarray:
        start, end = offsets[name]
        return data[data_start + start : data_start + end]

    sums: dict[str, float] = {}
    scales: np.ndarray | None = None
    spans: dict[str, tuple[int, int]] = {}
    if codec == "int8":
        scales = raw(SCALES_NAME).view("<f4")
        _check_scales(scales)
        spans = int8_scale_spans({n: e.shape for n, e in expected.items() if e.level is not None}, block_size)
    with np.errstate(over="ignore", invalid="ignore"):  # overflowing products are expected here, not warnings
        for name, entry in expected.items():
            if entry.level is None:
                continue
            if codec == "int8":
                assert scales is not None
                start, count = spans[name]
                blocks = np.zeros(count, dtype=np.int64)
                q = raw(name).view("i1")
                step = max(1, CHUNK // block_size) * block_size
                for i in range(0, q.size, step):
                    _add_block_squares(blocks, q[i : i + step], first=i, block_size=block_size)
                sums[name] = _int8_total(blocks, scales[start : start + count])
            else:
                total, bad = _float_squares(raw(name).view("<f4" if codec == "fp32" else "<u2"), widen=codec == "bf16")
                _check_finite(name, bad)
                sums[name] = total
    return sums


def _check_scales(scales: np.ndarray) -> None:
    bad = np.flatnonzero(~np.isfinite(scales) | (scales < 0))
    if bad.size:
        raise Invalid(
            f"int8 payload: block scale {int(bad[0])} is {float(scales[bad[0]])!r}; scales must be finite and >= 0"
        )


def _check_finite(name: str, bad: int) -> None:
    if bad:
        raise Invalid(f"tensor {name!r} has {bad} non-finite value(s) (NaN/Inf)")


def _chunks(values: np.ndarray, *, widen: bool) -> Iterator[np.ndarray]:
    for i in range(0, values.size, CHUNK):
        chunk = values[i : i + CHUNK]
        # bf16 is the top half of a float32: shifting its bits up 16 gives the same number exactly
        yield (chunk.astype(np.uint32) << 16).view(np.float32) if widen else chunk


def _float_squares(values: np.ndarray, *, widen: bool = False) -> tuple[float, int]:
    """(sum of squares, number of NaN/Inf values) of float32 values, or of bf16 ones (`widen`, as uint16 bits).

    fp32: one BLAS dot product; a non-finite dot means a NaN/Inf value, or finite values so large that float32
    overflowed (e.g. 3.4e38): those are counted exactly, and only in the second case is the sum redone in
    float64, a chunk at a time. bf16 values are widened to float32 a chunk at a time."""
    if not widen:
        total = float(np.dot(values, values))
        if math.isfinite(total):
            return total, 0
    total, bad = 0.0, 0
    for chunk in _chunks(values, widen=widen):
        finite = np.isfinite(chunk)
        if not finite.all():
            bad += int(np.count_nonzero(~finite))
        elif not bad:
            wide = chunk.astype(np.float64)
            total += float(np.dot(wide, wide))
    return total, bad


def _add_block_squares(blocks: np.ndarray, q: np.ndarray, *, first: int, block_size: int) -> None:
    """Add the squares of int8 values `q` (elements `first`, `first + 1`, ... of their tensor) into their blocks'
    sums (`blocks`, int64: exact)."""
    sq = q.astype(np.int64) ** 2
    i, b = 0, first // block_size
    if first % block_size:
        i = min(block_size - first % block_size, sq.size)
        blocks[b] += sq[:i].sum()
        b += 1
    full = (sq.size - i) // block_size
    if full:
        blocks[b : b + full] += sq[i : i + full * block_size].reshape(full, block_size).sum(axis=1)
        i, b = i + full * block_size, b + full
    if i < sq.size:
        blocks[b] += sq[i:].sum()


def _int8_total(blocks: np.ndarray, scales: np.ndarray) -> float:
    """sum_b scale_b^2 * sum_{i in b} q_i^2."""
    s = scales.astype(np.float64)
    return float(np.dot(blocks.astype(np.float64), s * s))
