"""Tensor codecs: safetensors bytes in and out, with a dtype allow-list on decode. Never pickle.

`encode` / `decode` move fp32 tensors (weights, momentum). `encode_grad` / `decode_grad` move outer gradients
in one of three codecs, recorded in the safetensors metadata (`dipaco.codec`):

* `fp32`: the tensors as they are (4 bytes per value).
* `bf16`: rounded to bfloat16 (2 bytes per value; relative error <= 2**-8 per value).
* `int8`: per-block absmax scaling. Each tensor is flattened and cut into blocks of `block_size` values
  (the last block may be shorter); a block's scale is `absmax / 127` (fp32) and its values are
  `round(x / scale)` in [-127, 127]. Each tensor is stored as int8 under its own name (its shape), and the
  fp32 block scales of all tensors in one 1-D tensor `::scales`, concatenated in sorted-name order; block size
  in `dipaco.block_size`. Error per value <= scale / 2.

Sparse rows (`modules.sparse_rows`): `encode_grad(..., rows={name: ids})` sends only those rows of `name`, shape
(k, d), in the codec like any tensor, and their ids as `<name>::rows` (I64, (k,)); the int8 scales cover the
k rows. `decode_grad` / `decode_grad_part` return both tensors as sent (`expand_rows` makes them full size).

`ErrorFeedback` (sender side) keeps what quantisation lost per tensor name and adds it to the next round's
gradient, so the error does not accumulate over rounds. `grad_payload_nbytes` gives the exact payload size
from shapes alone (used for upload size caps and the byte counts in logs).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Literal

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from modules.sparse_rows import SPARSE_LEVEL, SPARSE_PARAM, expand_rows, is_rows, rows_name

DEFAULT_ALLOWED = frozenset({"F32"})


class CodecError(ValueError):
    """Bytes that are not a valid safetensors payload of the allowed kind."""


def encode(tensors: Mapping[str, torch.Tensor], *, metadata: dict[str, str] | None = None) -> bytes:
    return st_save({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, metadata=metadata)


def encode_pieces(tensors: Mapping[str, torch.Tensor]) -> list[bytes | memoryview]:
    """`encode(tensors)` in pieces whose concatenation is the same bytes, without copying the tensors' data: the
    safetensors header, then a view of each tensor's own memory (module weights and momentum of 117M parameters
    are 468 MB: `encode`'s copy took 0.5 s of a module step, docs/LOG.md 2026-12-04 session 5). Float32 tensors
    only, laid out as safetensors lays out tensors of one dtype: by name, the header padded with spaces to a
    multiple of 8 bytes. The views are valid while the tensors live and are not written to."""
    header: dict[str, object] = {}
    views: list[bytes | memoryview] = []
    offset = 0
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        if t.dtype != torch.float32:
            raise CodecError(f"tensor {name!r} is {t.dtype}; encode_pieces writes float32 tensors only")
        view = t.reshape(-1).numpy().data.cast("B")
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + view.nbytes]}
        offset += view.nbytes
        views.append(view)
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    raw += b" " * (-len(raw) % 8)
    return [struct.pack("<Q", len(raw)) + raw, *views]


def _parse_header(data: bytes) -> dict[str, object]:
    """The raw safetensors header of a payload (tensor entries and `__metadata__`), as a JSON object."""
    if len(data) < 8:
        raise CodecError(f"payload of {len(data)} bytes is too short for a safetensors header")
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8:
        raise CodecError(f"safetensors header claims {n} bytes but only {len(data) - 8} follow")
    try:
        header = json.loads(data[8 : 8 + n])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CodecError(f"safetensors header is not valid JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise CodecError("safetensors header is not a JSON object")
    return header


def read_header(data: bytes) -> dict[str, dict[str, object]]:
    """The tensor entries of a safetensors header (without `__metadata__`), read without touching tensor data."""
    header = _parse_header(data)
    header.pop("__metadata__", None)
    return header  # type: ignore[return-value]  # entries are checked by the caller (dtype, shape, offsets)


def decode(data: bytes, *, allowed_dtypes: frozenset[str] = DEFAULT_ALLOWED) -> dict[str, torch.Tensor]:
    header = read_header(data)
    for name, info in header.items():
        dtype = info.get("dtype") if isinstance(info, dict) else None
        if dtype not in allowed_dtypes:
            raise CodecError(f"tensor {name!r} has dtype {dtype}; allowed: {sorted(allowed_dtypes)}")
    try:
        return st_load(data)
    except (SafetensorError, ValueError, RuntimeError) as exc:
        raise CodecError(f"invalid safetensors payload: {exc}") from exc


GradCodec = Literal["fp32", "bf16", "int8"]
GRAD_CODECS: tuple[GradCodec, ...] = ("fp32", "bf16", "int8")
DEFAULT_BLOCK_SIZE = 256
MAX_BLOCK_SIZE = 1 << 20
"""Largest int8 block a payload may declare (a block is one fp32 scale for this many values)."""
"""int8 block: 256 values share one fp32 scale, i.e. 4/256 = 1.6 % overhead on top of 1 byte per value."""

_RESERVED = "::"
SCALES_NAME = "::scales"
"""int8 payloads: every tensor is stored as int8 under its own name, and the fp32 block scales of all of them
in this one 1-D tensor, concatenated in sorted-name order (one header entry instead of one per tensor)."""
# The dtypes each codec may carry; decode_grad refuses anything else.
_CODEC_DTYPES: dict[str, frozenset[str]] = {
    "fp32": frozenset({"F32"}),
    "bf16": frozenset({"BF16"}),
    "int8": frozenset({"I8", "F32"}),
}
_DTYPE_BYTES = {"I64": 8, "F32": 4, "BF16": 2, "I8": 1}
# safetensors lays tensors out by dtype (descending enum order: I64 > F32 > BF16 > I8) and then by name.
_DTYPE_RANK = {"I64": -1, "F32": 0, "BF16": 1, "I8": 2}
ROWS_DTYPE = "I64"
"""dtype of the `<name>::rows` tensors of sparse rows, whatever the codec."""


def read_metadata(data: bytes) -> dict[str, str]:
    """The `__metadata__` of a safetensors payload ({} when absent)."""
    meta = _parse_header(data).get("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise CodecError("safetensors __metadata__ is not a string-to-string object")
    return meta


def _check_codec(codec: str) -> None:
    if codec not in GRAD_CODECS:
        raise CodecError(f"unknown gradient codec {codec!r}; known: {list(GRAD_CODECS)}")


def _check_block_size(block_size: int) -> None:
    if block_size < 1:
        raise CodecError(f"int8 block_size must be >= 1, got {block_size}")


def quantize_int8(t: torch.Tensor, *, block_size: int = DEFAULT_BLOCK_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block absmax int8: (int8 values with t's shape, fp32 scales of ceil(numel / block_size))."""
    _check_block_size(block_size)
    flat = t.detach().float().reshape(-1)
    n = flat.numel()
    nblocks = math.ceil(n / block_size)
    padded = torch.nn.functional.pad(flat, (0, nblocks * block_size - n))
    # (nblocks * block_size,) -> (nblocks, block_size)
    blocks = padded.view(nblocks, block_size)
    scale = blocks.abs().amax(dim=1) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero block stays all zeros
    q = torch.round(blocks / safe[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.reshape(-1)[:n].reshape(t.shape), scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, *, block_size: int = DEFAULT_BLOCK_SIZE) -> torch.Tensor:
    """Inverse of `quantize_int8` (fp32, q's shape)."""
    _check_block_size(block_size)
    flat = q.reshape(-1).float()
    n = flat.numel()
    nblocks = math.ceil(n / block_size)
    if scale.numel() != nblocks:
        raise CodecError(f"{n} int8 values in blocks of {block_size} need {nblocks} scales, got {scale.numel()}")
    padded = torch.nn.functional.pad(flat, (0, nblocks * block_size - n)).view(nblocks, block_size)
    return (padded * scale.float()[:, None]).reshape(-1)[:n].reshape(q.shape)


def _grad_metadata(codec: str, block_size: int) -> dict[str, str]:
    meta = {"dipaco.codec": codec}
    if codec == "int8":
        meta["dipaco.block_size"] = str(block_size)
    return meta


class ErrorFeedback:
    """Sender-side error feedback: remembers, per tensor name, what the codec lost last time and adds it back.

    Use one per (path, module) on the island: `encode_grad(g, "int8", error_feedback=fb)`. After each encode,
    `residual[name] = (g + old residual) - decoded`. With `fp32` the residual stays zero, except on the rows of
    a sparse tensor that were not sent (decoded as zeros there): what the inner loop did to them waits in the
    residual until their tokens come back.
    """

    def __init__(self) -> None:
        self.residual: dict[str, torch.Tensor] = {}

    def compensate(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The gradient plus the residual kept for each name (names never seen get nothing added)."""
        out: dict[str, torch.Tensor] = {}
        for name, t in tensors.items():
            r = self.residual.get(name)
            out[name] = t.float() if r is None else t.float() + r
        return out

    def record(self, sent: Mapping[str, torch.Tensor], decoded: Mapping[str, torch.Tensor]) -> None:
        """Keep `sent - decoded` as the residual of each name."""
        for name, t in sent.items():
            self.residual[name] = t.float() - decoded[name].float()

    def reset(self) -> None:
        self.residual.clear()


def _encode_values(tensors: Mapping[str, torch.Tensor], codec: str, block_size: int) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    scales: list[torch.Tensor] = []
    for name in sorted(tensors):
        if _RESERVED in name:
            raise CodecError(f"tensor name {name!r} contains '::' (reserved codec suffix)")
        t = tensors[name].detach().cpu()
        if codec == "fp32":
            out[name] = t.float().contiguous()
        elif codec == "bf16":
            out[name] = t.to(torch.bfloat16).contiguous()
        else:
            q, scale = quantize_int8(t, block_size=block_size)
            out[name] = q.contiguous()
            scales.append(scale)
    if codec == "int8":
        out[SCALES_NAME] = torch.cat(scales) if scales else torch.zeros(0)
    return out


def encode_grad(
    tensors: Mapping[str, torch.Tensor],
    codec: GradCodec,
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    error_feedback: ErrorFeedback | None = None,
    rows: Mapping[str, torch.Tensor] | None = None,
) -> bytes:
    """Encode outer gradients as safetensors in `codec`; with `error_feedback`, compensate and update it.

    `rows` ({tensor name: sorted unique row ids}) sends only those rows of those tensors (sparse rows); the
    error feedback then sees zeros decoded on the other rows, so nothing of them is lost."""
    _check_codec(codec)
    _check_block_size(block_size)
    if not all(t.is_floating_point() for t in tensors.values()):
        raise CodecError("outer gradients must be floating-point tensors")
    rows = {name: ids.to(torch.int64).cpu().contiguous() for name, ids in (rows or {}).items()}
    unknown = sorted(set(rows) - set(tensors))
    if unknown:
        raise CodecError(f"rows given for tensors not in the gradient: {unknown}")
    sent = error_feedback.compensate(tensors) if error_feedback is not None else tensors
    values = {name: (t[rows[name]] if name in rows else t) for name, t in sent.items()}
    encoded = _encode_values(values, codec, block_size)
    encoded.update({rows_name(name): ids for name, ids in rows.items()})
    data = st_save(encoded, metadata=_grad_metadata(codec, block_size))
    if error_feedback is not None:
        error_feedback.record(sent, expand_rows(decode_grad(data), sent))  # zeros on the rows not sent
    return data


def received_grads(
    grads: Sequence[Mapping[str, torch.Tensor]],
    level_names: Sequence[str],
    codec: GradCodec,
    feedback: ErrorFeedback,
    *,
    rows: torch.Tensor | None = None,
) -> list[dict[str, torch.Tensor]]:
    """A worker's outer gradients (one mapping per level, levels named `level_names`) as the coordinator receives
    them: encoded with `codec` and the worker's error feedback, exactly as an island encodes its upload (one
    payload, tensors named `<level>/<param>`), decoded. With `rows` (sparse rows) the embedding goes as those
    rows, and comes back as a sparse part. The simulators' upload (`modules.simulate`, `modules.asynchrony`)."""
    if codec == "fp32" and rows is None:
        return [dict(g) for g in grads]
    names = list(level_names)[: len(grads)]
    flat = {f"{names[lv]}/{param}": t for lv, g in enumerate(grads) for param, t in g.items()}
    sparse = {f"{SPARSE_LEVEL}/{SPARSE_PARAM}": rows} if rows is not None else None
    decoded = expand_rows(decode_grad(encode_grad(flat, codec, error_feedback=feedback, rows=sparse)), flat)
    return [
        {name[len(names[lv]) + 1 :]: t for name, t in decoded.items() if name.startswith(f"{names[lv]}/")}
        for lv in range(len(grads))
    ]


def decode_grad(data: bytes) -> dict[str, torch.Tensor]:
    """Decode an `encode_grad` payload to fp32 tensors under their original names.

    Refuses (CodecError) an unknown codec, a dtype the codec does not carry, an int8 payload without its
    `::scales` tensor or with the wrong number of scales, and malformed or truncated payloads. The row ids of
    sparse rows (`<name>::rows`, I64) come back as they are, next to their (k, d) tensor.
    """
    meta = read_metadata(data)
    codec = meta.get("dipaco.codec")
    if codec is None:
        raise CodecError("payload has no 'dipaco.codec' metadata; it was not written by encode_grad")
    _check_codec(codec)
    header = read_header(data)
    allowed = _CODEC_DTYPES[codec]
    for name, info in header.items():
        dtype = info.get("dtype") if isinstance(info, dict) else None
        if is_rows(name):
            if dtype != ROWS_DTYPE:
                raise CodecError(f"tensor {name!r} has dtype {dtype}, expected {ROWS_DTYPE}")
            continue
        if dtype not in allowed:
            raise CodecError(f"tensor {name!r} has dtype {dtype}; codec {codec} allows {sorted(allowed)}")
        if codec == "int8":
            want = "F32" if name == SCALES_NAME else "I8"
            if dtype != want:
                raise CodecError(f"tensor {name!r} has dtype {dtype}, expected {want}")
    try:
        raw = st_load(data)
    except (SafetensorError, ValueError, RuntimeError) as exc:
        raise CodecError(f"invalid safetensors payload: {exc}") from exc
    row_ids = {name: raw.pop(name) for name in [n for n in raw if is_rows(n)]}
    if codec != "int8":
        return {**{name: t.float() for name, t in raw.items()}, **row_ids}
    try:
        block_size = int(meta.get("dipaco.block_size", ""))
    except ValueError as exc:
        bad = meta.get("dipaco.block_size")
        raise CodecError(f"int8 payload has a bad dipaco.block_size {bad!r}") from exc
    _check_block_size(block_size)
    scales = raw.pop(SCALES_NAME, None)
    if scales is None:
        raise CodecError(f"int8 payload has no {SCALES_NAME!r} tensor")
    out: dict[str, torch.Tensor] = {}
    offset = 0
    for name in sorted(raw):
        q = raw[name]
        count = math.ceil(q.numel() / block_size)
        out[name] = dequantize_int8(q, scales[offset : offset + count], block_size=block_size)
        offset += count
    if offset != scales.numel():
        raise CodecError(
            f"int8 payload: {len(raw)} tensors in blocks of {block_size} need {offset} scales, got {scales.numel()}"
        )
    return {**out, **row_ids}


def int8_scale_spans(shapes: Mapping[str, Sequence[int]], block_size: int) -> dict[str, tuple[int, int]]:
    """Where each tensor's block scales sit in an int8 payload's `::scales`: name -> (start, count), tensors in
    sorted-name order, `ceil(numel / block_size)` scales each (row ids of sparse rows have none)."""
    _check_block_size(block_size)
    spans: dict[str, tuple[int, int]] = {}
    offset = 0
    for name in sorted(n for n in shapes if not is_rows(n)):
        count = math.ceil(math.prod(int(d) for d in shapes[name]) / block_size)
        spans[name] = (offset, count)
        offset += count
    return spans


def payload_codec(metadata: Mapping[str, str] | None) -> tuple[str, int]:
    """(codec, int8 block size) of a payload from its safetensors metadata; a payload without `dipaco.codec`
    (written by plain `encode`) is fp32. Raises CodecError for an unknown codec or a bad block size."""
    meta = metadata or {}
    codec = meta.get("dipaco.codec", "fp32")
    _check_codec(codec)
    if codec != "int8":
        return codec, DEFAULT_BLOCK_SIZE
    raw = meta.get("dipaco.block_size", "")
    if not raw.isdigit():
        raise CodecError(f"int8 payload has a bad dipaco.block_size {raw!r}")
    block_size = int(raw)
    if not 1 <= block_size <= MAX_BLOCK_SIZE:
        raise CodecError(f"int8 block size must be in [1, {MAX_BLOCK_SIZE}], got {block_size}")
    return codec, block_size


def grad_part_names(names: Iterable[str], metadata: Mapping[str, str] | None, prefix: str) -> list[str]:
    """The tensors `decode_grad_part` reads for one module: those named `prefix...` (the row ids of sparse rows
    included) and, in an int8 payload, the block scales `::scales` (a blob store that reads byte ranges fetches
    only these)."""
    codec, _ = payload_codec(metadata)
    own = [name for name in names if name.startswith(prefix) and name != SCALES_NAME]
    return [*own, SCALES_NAME] if codec == "int8" else own


def decode_grad_part(
    shapes: Mapping[str, Sequence[int]],
    metadata: Mapping[str, str] | None,
    get_tensor: Callable[[str], torch.Tensor],
    prefix: str,
) -> dict[str, torch.Tensor]:
    """The fp32 tensors of one module (names starting with `prefix`, stripped) of an outer-gradient payload read
    lazily: `shapes` are every tensor's shape from the header and `get_tensor` reads one tensor (a memory map),
    so only that module's tensors and, for int8, the block scales are read. Sparse rows come back as sent:
    `<param>` (k, d) and `<param>::rows` (int64)."""
    codec, block_size = payload_codec(metadata)
    names = [name for name in shapes if name.startswith(prefix) and name != SCALES_NAME and not is_rows(name)]
    row_ids = {name[len(prefix) :]: get_tensor(name) for name in shapes if name.startswith(prefix) and is_rows(name)}
    if codec != "int8":
        return {**{name[len(prefix) :]: get_tensor(name).float() for name in names}, **row_ids}
    spans = int8_scale_spans({k: v for k, v in shapes.items() if k != SCALES_NAME}, block_size)
    scales = get_tensor(SCALES_NAME)
    values = {
        name[len(prefix) :]: dequantize_int8(
            get_tensor(name), scales[spans[name][0] : spans[name][0] + spans[name][1]], block_size=block_size
        )
        for name in names
    }
    return {**values, **row_ids}


def grad_payload_nbytes(
    shapes: Mapping[str, Sequence[int]], codec: GradCodec, *, block_size: int = DEFAULT_BLOCK_SIZE
) -> int:
    """Exact size in bytes of `encode_grad` for tensors of these names and shapes (header included); with sparse
    rows, give the sent shape (k, d) and the `<name>::rows` entry (k,).

    Rebuilds the safetensors header the way the library writes it (tensors ordered by dtype then name,
    compact JSON, padded with spaces to a multiple of 8), so no tensor has to be allocated.
    """
    _check_codec(codec)
    _check_block_size(block_size)
    entries: list[tuple[str, str, list[int]]] = []
    total_scales = 0
    for name, shape in shapes.items():
        dims = [int(d) for d in shape]
        if is_rows(name):
            entries.append((name, ROWS_DTYPE, dims))
        elif codec == "fp32":
            entries.append((name, "F32", dims))
        elif codec == "bf16":
            entries.append((name, "BF16", dims))
        else:
            entries.append((name, "I8", dims))
            total_scales += math.ceil(math.prod(dims) / block_size)
    if codec == "int8":
        entries.append((SCALES_NAME, "F32", [total_scales]))
    entries.sort(key=lambda e: (_DTYPE_RANK[e[1]], e[0]))
    header: dict[str, object] = {"__metadata__": _grad_metadata(codec, block_size)}
    offset = 0
    for name, dtype, dims in entries:
        size = math.prod(dims) * _DTYPE_BYTES[dtype]
        header[name] = {"dtype": dtype, "shape": dims, "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    padded = len(text) + (-len(text)) % 8
    return 8 + padded + offset
