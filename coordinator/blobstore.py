"""Content-addressed blob stores: weights, momentum, outer gradients and shards, named by their sha256.

Two backends with one interface (`BlobStore`):
- `LocalBlobStore`: a directory. Writes go to a temporary file in the same file system, are fsynced and renamed
  into place, so a blob is either complete or absent.
- `S3BlobStore`: an S3-compatible bucket through boto3 (AWS S3, MinIO, Ceph, ...). A PUT is atomic: the object
  appears complete or not at all.
The database references a blob only after `put_*` returned. Every read of a whole blob verifies its content
hash; `S3BlobStore.load_tensors` reads one module's byte ranges of an outer gradient, which was hashed when it got
its name (see there).

Staging: an upload whose sender names its sha256 waits under `staging/<name>`, outside the content-addressed
names, until an apply executor has hashed it (`open_staged`) and given it its name (`promote_staged`); islands
PUT their direct uploads there on S3, and the coordinator moves a named upload there on either store, so that
hashing is not on the request path (services/staging.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, BinaryIO, Protocol

import torch
from safetensors import safe_open

from modules.codec import CodecError, decode_grad_part, encode_pieces, grad_part_names, read_header, read_metadata

CHUNK = 1 << 20
STAGING = "staging"
"""Key prefix (under the store's own) of uploads PUT directly by islands and not yet verified."""


class BlobError(Exception):
    """A missing or corrupted blob, or an unreachable store."""


class BlobMissing(BlobError):
    """Nothing is stored under that name or staging key (never written, or deleted)."""


class StagedChanged(BlobError):
    """A staged upload whose size is not the one recorded when it was committed (written again after the commit):
    refused before it is read."""

    def __init__(self, key: str, size: int, expected: int) -> None:
        super().__init__(f"the object at {key} has {size} bytes, {expected} were committed")
        self.key = key
        self.size = size
        self.expected = expected


def check_digest(digest: str) -> str:
    if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise BlobError(f"not a sha256 hex digest: {digest!r}")
    return digest


class BlobStore(Protocol):
    def exists(self, digest: str) -> bool: ...

    def put_bytes(self, data: bytes) -> str: ...

    def put_tensors(self, tensors: Mapping[str, torch.Tensor]) -> str:
        """Store float32 tensors as one safetensors blob, `modules.codec.encode`'s bytes (so its name is
        sha256(encode(tensors))), without building those bytes in memory where the store can stream them."""
        ...

    def put_stream(self, src: BinaryIO) -> tuple[str, int]:
        """Copy a readable file into the store; returns (sha256, size)."""
        ...

    def put_file(self, path: Path, digest: str) -> None:
        """Move a complete file whose sha256 the caller computed into the store (the file is consumed)."""
        ...

    def get_bytes(self, digest: str) -> bytes: ...

    def load_tensors(self, digest: str, prefix: str, *, verified: set[str]) -> dict[str, torch.Tensor]:
        """The fp32 tensors of an outer-gradient blob whose names start with `prefix` (prefix stripped), decoded
        from the blob's codec (`modules.codec.decode_grad_part`). The blob's hash is checked once per `verified`
        set, so one apply reads each upload's hash once."""
        ...

    def iter_verified(self, digest: str) -> Iterator[bytes]:
        """Stream a blob; raises BlobError at the end if the content does not match its name."""
        ...

    def staging_key(self, name: str) -> str:
        """Where an upload waits, outside the content-addressed names, until it is verified."""
        ...

    def stage_file(self, path: Path, key: str) -> None:
        """Move a complete file to `key` (a `staging_key`), durably; the file is consumed."""
        ...

    def open_staged(self, key: str, *, size: int) -> contextlib.AbstractContextManager[tuple[Path, str]]:
        """A local file holding the staged upload and its sha256, for as long as the context lasts. `size`: the
        size recorded when it was committed; an upload of another size raises `StagedChanged` before more than
        `size` bytes of it are read. Raises `BlobMissing` when nothing is staged at `key`, BlobError when it
        cannot be read."""
        ...

    def promote_staged(self, key: str, digest: str) -> None:
        """Give a verified upload its content-addressed name; the staged copy stays until `delete_staged`.
        Idempotent: a second executor finds it done."""
        ...

    def delete_staged(self, key: str) -> None: ...

    def list_staged(self) -> Iterator[tuple[str, datetime]]:
        """Every staged key, with when it was written (UTC)."""
        ...


def _staging_name(name: str) -> str:
    if not name or "/" in name or ".." in name or name.startswith("."):
        raise BlobError(f"bad staging name {name!r}")
    return name


class LocalBlobStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)
        self._tmp = root / "tmp"
        self._tmp.mkdir(exist_ok=True)

    def path(self, digest: str) -> Path:
        check_digest(digest)
        return self.root / digest[:2] / digest

    def exists(self, digest: str) -> bool:
        return self.path(digest).is_file()

    def put_bytes(self, data: bytes) -> str:
        digest = hashlib.sha256(data).hexdigest()
        if not self.exists(digest):
            with self._writing(lambda: self.path(digest)) as out:
                out.write(data)
        return digest

    def put_tensors(self, tensors: Mapping[str, torch.Tensor]) -> str:
        h = hashlib.sha256()
        with self._writing(lambda: self.path(h.hexdigest())) as out:
            for piece in encode_pieces(tensors):
                h.update(piece)
                out.write(piece)
        return h.hexdigest()

    def put_stream(self, src: BinaryIO) -> tuple[str, int]:
        h = hashlib.sha256()
        size = 0
        with self._writing(lambda: self.path(h.hexdigest())) as out:
            while chunk := src.read(CHUNK):
                h.update(chunk)
                out.write(chunk)
                size += len(chunk)
        return h.hexdigest(), size

    @contextlib.contextmanager
    def _writing(self, target: Callable[[], Path]) -> Iterator[BinaryIO]:
        """Write a new file durably: into a temporary file of the store, fsynced and renamed to `target()` when
        the block ends without error (the name may depend on what was written); removed otherwise."""
        fd, tmp_name = tempfile.mkstemp(dir=self._tmp)
        try:
            with os.fdopen(fd, "wb") as out:
                yield out
                out.flush()
                os.fsync(out.fileno())
            dest = target()
            dest.parent.mkdir(exist_ok=True)
            os.replace(tmp_name, dest)
        finally:
            if os.path.exists(tmp_name):
                os.unlink(tmp_name)

    def put_file(self, path: Path, digest: str) -> None:
        check_digest(digest)
        if self.exists(digest):
            path.unlink(missing_ok=True)
            return
        with path.open("rb") as f:
            os.fsync(f.fileno())
        try:
            self._publish(str(path), digest)
        except OSError:  # another file system: copy instead of rename
            with path.open("rb") as f:
                got, _ = self.put_stream(f)
            path.unlink(missing_ok=True)
            if got != digest:
                raise BlobError(f"file {path} hashes to {got}, not {digest}") from None

    def load_tensors(self, digest: str, prefix: str, *, verified: set[str]) -> dict[str, torch.Tensor]:
        if digest not in verified:
            for _ in self.iter_verified(digest):
                pass
            verified.add(digest)
        # memory-mapped: only the tensors asked for (and an int8 payload's scales) are read
        with safe_open(str(self.path(digest)), framework="pt") as f:
            shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}
            return decode_grad_part(shapes, f.metadata(), f.get_tensor, prefix)

    def _publish(self, tmp_name: str, digest: str) -> None:
        target = self.path(digest)
        target.parent.mkdir(exist_ok=True)
        os.replace(tmp_name, target)

    def get_bytes(self, digest: str) -> bytes:
        try:
            data = self.path(digest).read_bytes()
        except FileNotFoundError as exc:
            raise BlobError(f"blob {digest} is missing from {self.root}") from exc
        return _verified(digest, data)

    def iter_verified(self, digest: str) -> Iterator[bytes]:
        try:
            f = self.path(digest).open("rb")
        except FileNotFoundError as exc:
            raise BlobError(f"blob {digest} is missing from {self.root}") from exc
        with f:
            yield from _verify_chunks(digest, iter(lambda: f.read(CHUNK), b""))

    # -- staging: named uploads wait here until an executor has hashed them -----------------------------------

    def staging_key(self, name: str) -> str:
        return f"{STAGING}/{_staging_name(name)}"

    def _staged_path(self, key: str) -> Path:
        prefix, _, name = key.partition("/")
        if prefix != STAGING:
            raise BlobError(f"not a staging key: {key!r}")
        return self.root / STAGING / _staging_name(name)

    def stage_file(self, path: Path, key: str) -> None:
        target = self._staged_path(key)
        target.parent.mkdir(exist_ok=True)
        with path.open("rb") as f:
            os.fsync(f.fileno())
        try:
            os.replace(path, target)
        except OSError:  # another file system: a copy, renamed into place
            with self._writing(lambda: target) as out, path.open("rb") as src:
                shutil.copyfileobj(src, out, CHUNK)
            path.unlink(missing_ok=True)
        _fsync_dir(target.parent)  # the rename itself survives a crash: the database is about to point at it

    @contextlib.contextmanager
    def open_staged(self, key: str, *, size: int) -> Iterator[tuple[Path, str]]:
        # A name of our own for the bytes: another executor that finishes first removes the staged name meanwhile.
        mine, staged = self._tmp / f"verify-{os.getpid()}-{uuid.uuid4().hex}", self._staged_path(key)
        try:
            _link_or_copy(staged, mine)
        except FileNotFoundError as exc:
            raise BlobMissing(f"nothing is staged at {key} in {self.root}") from exc
        try:
            if (actual_size := mine.stat().st_size) != size:
                raise StagedChanged(key, actual_size, size)
            with mine.open("rb") as f:
                digest = hashlib.file_digest(f, "sha256").hexdigest()
            yield mine, digest
        finally:
            mine.unlink(missing_ok=True)

    def promote_staged(self, key: str, digest: str) -> None:
        if self.exists(digest):
            return
        target = self.path(digest)
        target.parent.mkdir(exist_ok=True)
        try:
            os.link(self._staged_path(key), target)  # a second name for the same bytes: nothing is copied
        except FileExistsError:
            pass  # another executor promoted it first
        except OSError:  # no hard links here: a copy, hashed again on the way
            with self._staged_path(key).open("rb") as f:
                got, _ = self.put_stream(f)
            if got != digest:
                raise BlobError(f"staged upload {key} hashes to {got}, not {digest}") from None

    def delete_staged(self, key: str) -> None:
        self._staged_path(key).unlink(missing_ok=True)

    def list_staged(self) -> Iterator[tuple[str, datetime]]:
        try:
            entries = list(os.scandir(self.root / STAGING))
        except FileNotFoundError:
            return
        for entry in entries:
            try:
                written = datetime.fromtimestamp(entry.stat().st_mtime, UTC)
            except FileNotFoundError:
                continue  # promoted and removed meanwhile
            yield f"{STAGING}/{entry.name}", written


class S3BlobStore:
    """Blobs as objects `<prefix><aa>/<sha256>` in one bucket."""

    def __init__(self, *, bucket: str, prefix: str = "", client: Any) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.client = client

    def key(self, digest: str) -> str:
        check_digest(digest)
        return f"{self.prefix}{digest[:2]}/{digest}"

    def exists(self, digest: str) -> bool:
        from botocore.exceptions import ClientError

        try:
            self.client.head_object(Bucket=self.bucket, Key=self.key(digest))
            return True
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return False
            raise BlobError(f"s3://{self.bucket}/{self.key(digest)}: {exc}") from exc

    def put_bytes(self, data: bytes) -> str:
        digest = hashlib.sha256(data).hexdigest()
        if not self.exists(digest):
            self.client.put_object(Bucket=self.bucket, Key=self.key(digest), Body=data)
        return digest

    def put_tensors(self, tensors: Mapping[str, torch.Tensor]) -> str:
        # one PUT of known content (the hash names the key before it): the pieces joined, `encode`'s bytes
        return self.put_bytes(b"".join(encode_pieces(tensors)))

    def put_stream(self, src: BinaryIO) -> tuple[str, int]:
        # The key is the content hash, so the content is hashed into a local spool file first.
        with tempfile.TemporaryFile() as spool:
            h = hashlib.sha256()
            size = 0
            while chunk := src.read(CHUNK):
                h.update(chunk)
                spool.write(chunk)
                size += len(chunk)
            digest = h.hexdigest()
            if not self.exists(digest):
                spool.seek(0)
                self.client.upload_fileobj(spool, self.bucket, self.key(digest))
        return digest, size

    def put_file(self, path: Path, digest: str) -> None:
        check_digest(digest)
        if not self.exists(digest):
            self.client.upload_file(str(path), self.bucket, self.key(digest))
        path.unlink(missing_ok=True)

    # -- direct transfers: islands move the bytes to and from the bucket with pre-signed URLs ---------------------

    def presign_get(self, digest: str, *, expires_s: float) -> str:
        """A URL anyone holding it may GET the blob with, until it expires (the reader checks the hash)."""
        return str(
            self.client.generate_presigned_url(
                "get_object", Params={"Bucket": self.bucket, "Key": self.key(digest)}, ExpiresIn=int(expires_s)
            )
        )

    def staging_key(self, name: str) -> str:
        """Where an upload waits, outside the content-addressed names, until it is verified."""
        return f"{self.prefix}{STAGING}/{_staging_name(name)}"

    def stage_file(self, path: Path, key: str) -> None:
        self.client.upload_file(str(path), self.bucket, key)
        path.unlink(missing_ok=True)

    def presign_put(self, key: str, *, expires_s: float) -> str:
        """A URL to PUT one upload to `key` (a `staging_key`), until it expires. S3 cannot revoke it sooner, so an
        island may PUT again after its commit: the executor refuses an object whose size is not the committed one
        before reading it (`open_staged`), and one of that size that does not hash to the committed sha256."""
        return str(
            self.client.generate_presigned_url(
                "put_object", Params={"Bucket": self.bucket, "Key": key}, ExpiresIn=int(expires_s)
            )
        )

    # -- multipart direct uploads: a large body goes to its staging key in parts ---------------------------------

    def start_multipart(self, key: str) -> str:
        """Begin a multipart upload to `key` (a `staging_key`); its upload id."""
        from botocore.exceptions import ClientError

        try:
            return str(self.client.create_multipart_upload(Bucket=self.bucket, Key=key)["UploadId"])
        except ClientError as exc:
            raise BlobError(f"s3://{self.bucket}/{key}: cannot begin a multipart upload: {exc}") from exc

    def presign_part(self, key: str, upload_id: str, number: int, *, expires_s: float) -> str:
        """A URL to PUT part `number` (1-based) of multipart upload `upload_id`, until it expires."""
        params = {"Bucket": self.bucket, "Key": key, "UploadId": upload_id, "PartNumber": number}
        return str(self.client.generate_presigned_url("upload_part", Params=params, ExpiresIn=int(expires_s)))

    def complete_multipart(self, key: str, upload_id: str, parts: Sequence[tuple[int, str]]) -> None:
        """Join the parts, (number, ETag as the bucket answered its PUT) in order, into the object at `key`. Raises
        `PartsRefused` when the bucket refuses the list (a part not uploaded, an ETag that is not the part's, a part
        but the last under S3's 5 MiB, an upload id unknown, aborted or already completed)."""
        from botocore.exceptions import ClientError

        listed = {"Parts": [{"PartNumber": number, "ETag": etag} for number, etag in parts]}
        try:
            self.client.complete_multipart_upload(
                Bucket=self.bucket, Key=key, UploadId=upload_id, MultipartUpload=listed
            )
        except ClientError as exc:
            code = _code(exc)
            if code in _PARTS_REFUSED:
                message = exc.response.get("Error", {}).get("Message") or code
                raise PartsRefused(code, f"multipart upload {upload_id!r} to {key}: {code}: {message}") from exc
            raise BlobError(f"s3://{self.bucket}/{key}: cannot complete multipart upload: {exc}") from exc

    def abort_multipart(self, key: str, upload_id: str) -> None:
        """Drop an unfinished multipart upload and its parts; nothing when it is completed or gone already."""
        from botocore.exceptions import ClientError

        try:
            self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
        except ClientError as exc:
            if _code(exc) not in ("NoSuchUpload", *_MISSING):
                raise BlobError(f"s3://{self.bucket}/{key}: cannot abort multipart upload: {exc}") from exc

    def list_multipart(self) -> Iterator[tuple[str, str, datetime]]:
        """Unfinished multipart uploads to staging keys: (key, upload id, when it was begun, UTC)."""
        pages = self.client.get_paginator("list_multipart_uploads").paginate(
            Bucket=self.bucket, Prefix=f"{self.prefix}{STAGING}/"
        )
        for page in pages:
            for item in page.get("Uploads", []):
                yield str(item["Key"]), str(item["UploadId"]), item["Initiated"].astimezone(UTC)

    # -- reading parts of objects -----------------------------------------------------------------------------------

    def _get_range(self, key: str, start: int, end: int, *, held: str = "stored") -> Any | None:
        """The reply to a GET of bytes [start, end) of the object at `key` (its body still to be read and closed);
        None when the object has no byte `start` (an empty one, for 0). Raises `BlobMissing` ("nothing is `held`
        at ...") when there is no object at `key`, BlobError when the store fails."""
        from botocore.exceptions import ClientError

        try:
            return self.client.get_object(Bucket=self.bucket, Key=key, Range=f"bytes={start}-{end - 1}")
        except ClientError as exc:
            code = _code(exc)
            if code in _MISSING:
                raise BlobMissing(f"nothing is {held} at s3://{self.bucket}/{key}") from exc
            if code in _EMPTY:
                return None
            raise BlobError(f"s3://{self.bucket}/{key} cannot be read: {exc}") from exc

    def _first_bytes(self, key: str, length: int) -> tuple[int, bytes]:
        """An object's size and its first `length` bytes (fewer when it is shorter), in one ranged GET; raises
        `BlobMissing` when there is no object at `key`."""
        reply = self._get_range(key, 0, length)
        if reply is None:  # an empty object has no byte 0
            return 0, b""
        data = _read_and_close(reply["Body"], length)  # at most what was asked for, whatever the server sends
        return _object_size(reply, len(data)), data

    def _range(self, key: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of an object, in one ranged GET."""
        if end <= start:
            return b""
        reply = self._get_range(key, start, end)
        data = b"" if reply is None else _read_and_close(reply["Body"], end - start)
        if len(data) != end - start:
            raise BlobError(f"s3://{self.bucket}/{key}: bytes [{start}, {end}) came back as {len(data)} bytes")
        return data

    def staged_head(self, key: str, length: int) -> tuple[int, bytes] | None:
        """The staged upload's size and its first `length` bytes (fewer when it is shorter), in one ranged GET;
        None when nothing was PUT there."""
        try:
            return self._first_bytes(key, length)
        except BlobMissing:
            return None

    def staged_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of a staged upload (its safetensors header, read without the rest)."""
        return self._range(key, start, end)

    @contextlib.contextmanager
    def open_staged(self, key: str, *, size: int) -> Iterator[tuple[Path, str]]:
        """Streamed from the bucket into a temporary file, hashed on the way: one GET of bytes [0, size), so an
        object written again after its commit is neither downloaded nor spooled beyond the committed size; its
        size (from the reply's Content-Range) is checked before its body is read."""
        if size < 1:
            raise StagedChanged(key, -1, size)  # nothing committed is empty: a safetensors body has a header
        reply = self._get_range(key, 0, size, held="staged")
        if reply is None:
            raise StagedChanged(key, 0, size)
        body = reply["Body"]
        with contextlib.closing(body), tempfile.TemporaryDirectory(prefix="dipaco-staged-") as tmp:
            total = _object_size(reply, -1)
            if total != size:
                raise StagedChanged(key, total, size)
            path = Path(tmp) / "upload"
            h = hashlib.sha256()
            read = 0
            try:
                with path.open("wb") as out:
                    while read < size and (chunk := body.read(min(CHUNK, size - read))):
                        h.update(chunk)
                        out.write(chunk)
                        read += len(chunk)
            except Exception as exc:  # noqa: BLE001 - botocore's errors have no common base worth naming here
                raise BlobError(f"s3://{self.bucket}/{key} cannot be read: {exc}") from exc
            if read != size:
                raise BlobError(f"s3://{self.bucket}/{key}: the read stopped after {read} of {size} bytes")
            yield path, h.hexdigest()

    def promote_staged(self, key: str, digest: str) -> None:
        """A copy inside the bucket: no bytes leave it."""
        if not self.exists(digest):
            self.client.copy_object(
                Bucket=self.bucket, Key=self.key(digest), CopySource={"Bucket": self.bucket, "Key": key}
            )

    def delete_staged(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=key)

    def list_staged(self) -> Iterator[tuple[str, datetime]]:
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=f"{self.prefix}{STAGING}/"
        )
        for page in pages:
            for item in page.get("Contents", []):
                yield str(item["Key"]), item["LastModified"].astimezone(UTC)

    def load_tensors(self, digest: str, prefix: str, *, verified: set[str]) -> dict[str, torch.Tensor]:
        """Only the module's bytes are read, so memory is O(module), not O(upload): the header with one ranged GET
        (`HEAD_READ`; a second one when it is longer), then one ranged GET per contiguous run of the tensors
        `decode_grad_part` needs (`modules.codec.grad_part_names`: the module's own, and an int8 payload's scales).

        Unlike the local store this does not hash the whole blob (`verified` is not used): that would read every
        module's bytes for each module. The blob was hashed when it got its content name: an upload through the
        coordinator as it streamed in (`put_file`, `put_stream`), or by the apply executor before `promote_staged`
        (a direct upload, a large named one: `staging.verify_staged`), and S3 checks each PUT's own checksum. What
        is checked here: the header (JSON; every entry's dtype, shape and offsets agree and lie inside the object,
        whose size must be the header's plus the data's). Bytes changed inside the bucket after that are not
        detected here; `get_bytes` and `iter_verified` (weights, momentum, downloads) still hash everything."""
        key = self.key(digest)
        size, head = self._first_bytes(key, HEAD_READ)
        if size < 8:
            raise BlobError(f"blob {digest} of {size} bytes is too short for a safetensors payload")
        n = int.from_bytes(head[:8], "little")
        if 8 + n > size:
            raise BlobError(f"blob {digest}: a safetensors header of {n} bytes in an object of {size} bytes")
        if len(head) < 8 + n:
            head += self._range(key, len(head), 8 + n)
        try:
            header, metadata = read_header(head[: 8 + n]), read_metadata(head[: 8 + n])
            entries = _tensor_entries(header, data_size=size - 8 - n)
            names = grad_part_names(entries, metadata, prefix)
        except CodecError as exc:
            raise BlobError(f"blob {digest}: {exc}") from exc
        tensors: dict[str, torch.Tensor] = {}
        for start, end, group in _contiguous_runs(entries, names):
            buffer = bytearray(self._range(key, 8 + n + start, 8 + n + end))
            for name in group:
                tensors[name] = entries[name].tensor(buffer, base=start)
        shapes = {name: entry.shape for name, entry in entries.items()}
        return decode_grad_part(shapes, metadata, tensors.__getitem__, prefix)

    def _body(self, digest: str) -> Any:
        from botocore.exceptions import ClientError

        try:
            return self.client.get_object(Bucket=self.bucket, Key=self.key(digest))["Body"]
        except ClientError as exc:
            if _code(exc) in _MISSING:
                raise BlobMissing(f"blob {digest} is missing from s3://{self.bucket}/{self.prefix}: {exc}") from exc
            raise BlobError(f"blob {digest} cannot be read from s3://{self.bucket}/{self.prefix}: {exc}") from exc

    def get_bytes(self, digest: str) -> bytes:
        return _verified(digest, self._body(digest).read())

    def iter_verified(self, digest: str) -> Iterator[bytes]:
        body = self._body(digest)
        yield from _verify_chunks(digest, body.iter_chunks(CHUNK))


HEAD_READ = 64 << 10
"""Bytes of an object read with its size when only its safetensors header is wanted (most headers fit)."""
_MISSING = ("404", "NoSuchKey", "NotFound")
_EMPTY = ("416", "InvalidRange")
_PARTS_REFUSED = ("InvalidPart", "InvalidPartOrder", "EntityTooSmall", "NoSuchUpload", "MalformedXML")


class PartsRefused(BlobError):
    """The bucket refused to join a multipart upload's parts as listed; `code` is S3's error code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def _code(exc: Any) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def _read_and_close(body: Any, length: int) -> bytes:
    """At most `length` bytes of a GET's streaming body, which is closed then."""
    try:
        return bytes(body.read(length))
    finally:
        body.close()


def _object_size(reply: Mapping[str, Any], default: int) -> int:
    """The whole object's size from a (ranged) GET's reply: Content-Range's total, else Content-Length."""
    total = str(reply.get("ContentRange") or "").rpartition("/")[2]
    if total.isdigit():
        return int(total)
    length = reply.get("ContentLength")
    return int(length) if length is not None else default


_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "I8": torch.int8, "I64": torch.int64}


@dataclass(frozen=True, slots=True)
class _Entry:
    """One tensor of a safetensors header: dtype, shape and its bytes [start, end) after the header."""

    dtype: torch.dtype
    shape: list[int]
    start: int
    end: int

    def tensor(self, buffer: bytearray, *, base: int) -> torch.Tensor:
        """The tensor from a buffer that holds bytes [base, ...) of the data (no copy)."""
        count = (self.end - self.start) // self.dtype.itemsize
        if count == 0:
            return torch.empty(self.shape, dtype=self.dtype)
        flat = torch.frombuffer(buffer, dtype=self.dtype, count=count, offset=self.start - base)
        return flat.reshape(self.shape)


def _tensor_entries(header: Mapping[str, Any], *, data_size: int) -> dict[str, _Entry]:
    """Every entry of a safetensors header, checked: a known dtype, a shape of non-negative integers, offsets
    inside the data whose length is the shape's; the entries together end where the data ends."""
    entries: dict[str, _Entry] = {}
    for name, info in header.items():
        fields: dict[str, Any] = info if isinstance(info, dict) else {}
        dtype = _DTYPES.get(str(fields.get("dtype")))
        shape, offsets = fields.get("shape"), fields.get("data_offsets")
        if (
            dtype is None
            or not isinstance(shape, list)
            or not all(isinstance(d, int) and d >= 0 for d in shape)
            or not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= data_size
            or offsets[1] - offsets[0] != math.prod(shape) * dtype.itemsize
        ):
            raise CodecError(f"tensor {name!r}: bad safetensors entry {info!r} (data of {data_size} bytes)")
        entries[name] = _Entry(dtype=dtype, shape=shape, start=offsets[0], end=offsets[1])
    end = max((e.end for e in entries.values()), default=0)
    if end != data_size:
        raise CodecError(f"the tensors end at byte {end} of the data, the object holds {data_size}")
    return entries


def _contiguous_runs(entries: Mapping[str, _Entry], names: Sequence[str]) -> list[tuple[int, int, list[str]]]:
    """The byte runs [start, end) that hold `names`, adjacent tensors merged into one run (one GET each)."""
    runs: list[tuple[int, int, list[str]]] = []
    for name in sorted(names, key=lambda n: (entries[n].start, entries[n].end)):
        entry = entries[name]
        if runs and entry.start <= runs[-1][1]:
            start, end, group = runs[-1]
            runs[-1] = (start, max(end, entry.end), [*group, name])
        else:
            runs.append((entry.start, entry.end, [name]))
    return runs


def _link_or_copy(src: Path, dest: Path) -> None:
    """A second name for a file (a copy where the file system has no hard links)."""
    try:
        os.link(src, dest)
    except FileNotFoundError:
        raise
    except OSError:
        shutil.copyfile(src, dest)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _verified(digest: str, data: bytes) -> bytes:
    actual = hashlib.sha256(data).hexdigest()
    if actual != digest:
        raise BlobError(f"blob {digest} is corrupted (content hashes to {actual})")
    return data


def _verify_chunks(digest: str, chunks: Iterator[bytes]) -> Iterator[bytes]:
    h = hashlib.sha256()
    for chunk in chunks:
        h.update(chunk)
        yield chunk
    if h.hexdigest() != digest:
        raise BlobError(f"blob {digest} is corrupted (content hashes to {h.hexdigest()})")


def open_blob_store(url: str, *, s3_endpoint_url: str | None = None) -> BlobStore:
    """`s3://bucket/prefix` or a local directory (`file:///path` or a plain path)."""
    if url.startswith("s3://"):
        try:
            import boto3
        except ImportError as exc:
            raise BlobError("an s3:// blob store needs boto3: pip install 'dipaco[s3]'") from exc
        bucket, _, prefix = url[len("s3://") :].partition("/")
        if not bucket:
            raise BlobError(f"blob store {url!r}: no bucket name")
        client = boto3.client("s3", endpoint_url=s3_endpoint_url)
        return S3BlobStore(bucket=bucket, prefix=prefix, client=client)
    if url.startswith("file://"):
        url = url[len("file://") :]
    elif "://" in url:
        raise BlobError(f"blob store {url!r}: use a directory, file:///path or s3://bucket/prefix")
    return LocalBlobStore(Path(url).resolve())
