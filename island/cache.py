"""Content-addressed on-disk cache of module weights and shard tokens: `<cache_dir>/blobs/<sha256>`.

Blobs are complete-or-absent: written to a temporary file in the same directory, then `os.replace`d into
place. A blob is verified (sha256) before it is trusted; a corrupt one is deleted and fetched again. So the
write is not fsynced: a blob torn by a power cut fails that check in the next process and is fetched again
(an fsync per blob cost an overlap lease ~0.5-3 ms for each module version it waits for, docs/LOG.md
2026-12-07 session 8). Shard token files can be large, so they are verified once per process and then read as a
`numpy.memmap`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from island.errors import IntegrityError

log = logging.getLogger(__name__)

_HASH = re.compile(r"^[0-9a-f]{64}$")
_READ_CHUNK = 1 << 22


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_READ_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


class BlobCache:
    """sha256-addressed blobs under `root/blobs/`."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.blobs = Path(root) / "blobs"
        self.blobs.mkdir(parents=True, exist_ok=True)
        self._verified: set[str] = set()
        self.hits = 0
        self.misses = 0

    def path(self, sha256: str) -> Path:
        if not _HASH.match(sha256):
            raise ValueError(f"not a lowercase hex sha256: {sha256!r}")
        return self.blobs / sha256

    def _verify(self, sha256: str) -> bool:
        """Whether the blob exists and hashes to its name; a corrupt blob is removed."""
        path = self.path(sha256)
        if sha256 in self._verified and path.exists():
            return True
        if not path.exists():
            return False
        actual = _file_sha256(path)
        if actual != sha256:
            log.warning("cache: blob %s is corrupt (hashes to %s); removing it", sha256, actual)
            path.unlink(missing_ok=True)
            return False
        self._verified.add(sha256)
        return True

    def get(self, sha256: str) -> bytes | None:
        """The blob's bytes if cached and intact, else None (always verified: weights are small)."""
        path = self.path(sha256)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        if hashlib.sha256(data).hexdigest() != sha256:
            log.warning("cache: blob %s is corrupt; removing it", sha256)
            path.unlink(missing_ok=True)
            self._verified.discard(sha256)
            return None
        return data

    def put(self, sha256: str, data: bytes) -> Path:
        """Store bytes under their hash (verified first), atomically (not durably: see the module docstring)."""
        actual = hashlib.sha256(data).hexdigest()
        if actual != sha256:
            raise IntegrityError(what="cache put", expected=sha256, actual=actual)
        final = self.path(sha256)
        fd, tmp = tempfile.mkstemp(prefix=f".tmp-{sha256[:16]}-", dir=self.blobs)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, final)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self._verified.add(sha256)
        return final

    def get_or_fetch(self, sha256: str, fetch: Callable[[], bytes]) -> bytes:
        """Cached bytes, or `fetch()` them, verify, store and return them."""
        data = self.get(sha256)
        if data is not None:
            self.hits += 1
            return data
        self.misses += 1
        data = fetch()
        self.put(sha256, data)
        return data

    def tokens(self, sha256: str, fetch: Callable[[], bytes]) -> np.ndarray:
        """A shard token file (little-endian uint16) as a read-only memmap, fetched on a miss."""
        if self._verify(sha256):
            self.hits += 1
        else:
            self.misses += 1
            self.put(sha256, fetch())
        path = self.path(sha256)
        size = path.stat().st_size
        if size % 2:
            raise IntegrityError(
                what=f"shard token file {sha256}", expected="an even number of bytes", actual=f"{size} bytes"
            )
        if size == 0:  # np.memmap refuses empty files
            return np.zeros(0, dtype="<u2")
        return np.memmap(path, dtype="<u2", mode="r")
