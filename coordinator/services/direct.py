"""Direct transfers (an s3:// blob store): the island PUTs its outer gradient to a pre-signed staging URL, in
parts when it is large (an S3 multipart upload), and commits it; the coordinator touches only its header.

A ticket (`direct_ticket`) names the staging key `<lease>-<sha256>` and carries one pre-signed PUT, or, for a body
of at least `direct_multipart_bytes`, a multipart upload id and one pre-signed URL per part (`plan_parts`). The
commit joins the parts (`join_parts`: the bucket checks every ETag, the order and S3's 5 MiB minimum), then reads
the header with one ranged GET (`staged_payload`); the values are verified by the apply executor before any math
(services/staging.py). A refused multipart commit aborts its upload (`UploadDesk.commit`); unfinished uploads
nothing commits are aborted by the staging sweep (`staging.sweep_staging`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from coordinator.blobstore import BlobStore, PartsRefused, S3BlobStore
from coordinator.errors import Conflict, Invalid
from coordinator.schemas import MAX_PARTS, UploadPart, UploadTicket
from coordinator.services.payloads import Payload, header_cap, header_length, validated_header
from modules import Layout, ModelConfig

STAGED_HEAD_READ = 64 << 10
"""Bytes of a direct upload read with its size at commit: a path's safetensors header fits in them."""


@dataclass(frozen=True, slots=True)
class Multipart:
    """A multipart direct upload as its commit names it: the upload id and (part number, ETag) in order."""

    upload_id: str
    parts: tuple[tuple[int, str], ...]


@dataclass(frozen=True, slots=True)
class DirectLimits:
    """How direct uploads are handed out (`Settings.direct_multipart_bytes`, `direct_part_bytes`,
    `presign_expiry_s`)."""

    multipart_bytes: int = 64 << 20
    part_bytes: int = 16 << 20
    expiry_s: float = 900.0


def plan_parts(size: int, part_bytes: int) -> list[tuple[int, int]]:
    """(offset, length) of each part of a body of `size` bytes: `part_bytes` each, the last one shorter; larger
    parts when `part_bytes` would make more than S3's 10,000."""
    part = max(part_bytes, -(-size // MAX_PARTS))
    return [(offset, min(part, size - offset)) for offset in range(0, size, part)]


def direct_ticket(blobs: S3BlobStore, key: str, size: int, *, limits: DirectLimits, now: datetime) -> UploadTicket:
    """Pre-signed URLs to PUT a body of `size` bytes to `key`: one, or a multipart upload's, one per part."""
    expires = now + timedelta(seconds=limits.expiry_s)
    if size < limits.multipart_bytes:
        return UploadTicket(url=blobs.presign_put(key, expires_s=limits.expiry_s), key=key, expires_at=expires)
    upload_id = blobs.start_multipart(key)
    parts = [
        UploadPart(
            number=number,
            offset=offset,
            size=length,
            url=blobs.presign_part(key, upload_id, number, expires_s=limits.expiry_s),
        )
        for number, (offset, length) in enumerate(plan_parts(size, limits.part_bytes), start=1)
    ]
    return UploadTicket(key=key, expires_at=expires, upload_id=upload_id, parts=parts)


def join_parts(blobs: S3BlobStore, key: str, multipart: Multipart, size: int) -> None:
    """Join a multipart upload's parts into the staged object at `key` (422 when the bucket refuses the list). A
    commit retried after an attempt that joined them finds the upload gone and an object of the committed size
    at `key`: that is the join done."""
    try:
        blobs.complete_multipart(key, multipart.upload_id, multipart.parts)
    except PartsRefused as exc:
        if exc.code == "NoSuchUpload":
            head = blobs.staged_head(key, 8)
            if head is not None and head[0] == size:
                return
        raise Invalid(f"the bucket refused to join the parts: {exc}") from exc


def staged_payload(
    blobs: BlobStore,
    key: str | None,
    size: int,
    multipart: Multipart | None,
    *,
    cfg: ModelConfig,
    layout: Layout,
    levels: dict[int, tuple[int, str]],
    codec: str,
    sparse_rows: bool,
) -> Payload:
    """A direct upload's header, read from the bucket with one ranged GET (two when the header is longer than
    `STAGED_HEAD_READ`), after its parts were joined (a multipart upload), and checked against the path's modules
    (`levels`) and the run's `codec` and `sparse_rows`; its values (finite, norms) are verified by the apply
    executor before any math (`staging.verify_staged`)."""
    if not isinstance(blobs, S3BlobStore) or key is None:
        raise Invalid("direct uploads need an s3:// blob store")
    if multipart is not None:
        join_parts(blobs, key, multipart, size)
    head = blobs.staged_head(key, STAGED_HEAD_READ)
    if head is None:
        raise Conflict(f"nothing was uploaded at {key}: PUT the body to the ticket's URL first")
    found, first = head
    if found != size:
        raise Invalid(f"the upload at {key} has {found} bytes, the commit says {size}")
    n = header_length(first[:8], cap=header_cap(cfg, layout, levels))
    need = min(8 + n, found)
    if len(first) < need:
        first += blobs.staged_range(key, len(first), need)
    header = validated_header(first[:need], found, cfg, layout, levels, codec=codec, sparse_rows=sparse_rows)
    return Payload(prefixes=header.prefixes, norms=dict.fromkeys(header.prefixes), codec=codec)
