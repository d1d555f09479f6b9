"""Content-addressed blob store: weights, momentum, outer gradients and shards, named by sha256.

Writes go to a temporary file in the same directory and are renamed into place, so a blob is either complete
or absent; the database references a blob only after `put_*` returned. Reads verify the hash.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

CHUNK = 1 << 20


class BlobError(Exception):
    """A missing or corrupted blob."""


class LocalBlobStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)
        self._tmp = root / "tmp"
        self._tmp.mkdir(exist_ok=True)

    def path(self, digest: str) -> Path:
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise BlobError(f"not a sha256 hex digest: {digest!r}")
        return self.root / digest[:2] / digest

    def exists(self, digest: str) -> bool:
        return self.path(digest).is_file()

    def put_bytes(self, data: bytes) -> str:
        digest = hashlib.sha256(data).hexdigest()
        if not self.exists(digest):
            self._write(digest, iter([data]))
        return digest

    def put_stream(self, src: BinaryIO) -> tuple[str, int]:
        """Copy a readable file into the store; returns (sha256, size)."""
        fd, tmp_name = tempfile.mkstemp(dir=self._tmp)
        h = hashlib.sha256()
        size = 0
        try:
            with os.fdopen(fd, "wb") as out:
                while chunk := src.read(CHUNK):
                    h.update(chunk)
                    out.write(chunk)
                    size += len(chunk)
                out.flush()
                os.fsync(out.fileno())
            digest = h.hexdigest()
            target = self.path(digest)
            target.parent.mkdir(exist_ok=True)
            os.replace(tmp_name, target)
            return digest, size
        finally:
            if os.path.exists(tmp_name):
                os.unlink(tmp_name)

    def _write(self, digest: str, chunks: Iterator[bytes]) -> None:
        target = self.path(digest)
        target.parent.mkdir(exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(dir=self._tmp)
        try:
            with os.fdopen(fd, "wb") as out:
                for chunk in chunks:
                    out.write(chunk)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp_name, target)
        finally:
            if os.path.exists(tmp_name):
                os.unlink(tmp_name)

    def get_bytes(self, digest: str) -> bytes:
        path = self.path(digest)
        try:
            data = path.read_bytes()
        except FileNotFoundError as exc:
            raise BlobError(f"blob {digest} is missing from {self.root}") from exc
        actual = hashlib.sha256(data).hexdigest()
        if actual != digest:
            raise BlobError(f"blob {digest} is corrupted (content hashes to {actual})")
        return data

    def iter_verified(self, digest: str) -> Iterator[bytes]:
        """Stream a blob; raises BlobError at the end if the content does not match its name."""
        h = hashlib.sha256()
        try:
            f = self.path(digest).open("rb")
        except FileNotFoundError as exc:
            raise BlobError(f"blob {digest} is missing from {self.root}") from exc
        with f:
            while chunk := f.read(CHUNK):
                h.update(chunk)
                yield chunk
        if h.hexdigest() != digest:
            raise BlobError(f"blob {digest} is corrupted (content hashes to {h.hexdigest()})")
