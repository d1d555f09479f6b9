"""BlobCache: atomic writes, verification on read, refetch of corrupt blobs, token memmaps."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import pytest

from island.cache import BlobCache
from island.errors import IntegrityError


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_get_or_fetch_stores_once_and_leaves_no_temp_files(tmp_path: Path) -> None:
    cache = BlobCache(tmp_path)
    data = b"weights" * 1000
    calls: list[int] = []

    def fetch() -> bytes:
        calls.append(1)
        return data

    assert cache.get_or_fetch(sha(data), fetch) == data
    assert cache.get_or_fetch(sha(data), fetch) == data
    assert len(calls) == 1 and (cache.hits, cache.misses) == (1, 1)
    assert sorted(p.name for p in (tmp_path / "blobs").iterdir()) == [sha(data)]


def test_corrupt_blob_is_detected_removed_and_refetched(tmp_path: Path) -> None:
    cache = BlobCache(tmp_path)
    data = b"module v3"
    cache.put(sha(data), data)
    cache.path(sha(data)).write_bytes(b"module v4")  # bit rot / a half-written file from an old version
    assert cache.get(sha(data)) is None
    assert not cache.path(sha(data)).exists()
    assert cache.get_or_fetch(sha(data), lambda: data) == data


def test_fetched_bytes_with_the_wrong_hash_are_not_stored(tmp_path: Path) -> None:
    cache = BlobCache(tmp_path)
    with pytest.raises(IntegrityError):
        cache.get_or_fetch(sha(b"expected"), lambda: b"something else")
    assert list((tmp_path / "blobs").iterdir()) == []


def test_a_failed_write_leaves_neither_blob_nor_temp_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = BlobCache(tmp_path)
    data = b"x" * 100

    real_fdopen = os.fdopen

    class DiskFull:
        """The temp file, opened for real, whose write fails as on a full disk."""

        def __init__(self, fd: int, mode: str) -> None:
            self._file = real_fdopen(fd, mode)

        def __enter__(self) -> DiskFull:
            return self

        def __exit__(self, *exc: object) -> None:
            self._file.close()

        def write(self, data: bytes) -> int:
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fdopen", DiskFull)
    with pytest.raises(OSError, match="No space"):
        cache.put(sha(data), data)
    assert list((tmp_path / "blobs").iterdir()) == []


def test_a_blob_a_power_cut_left_torn_is_fetched_again(tmp_path: Path) -> None:
    """What a crash could leave behind (a blob file short of its bytes, or empty) fails its hash and is replaced
    by a fresh fetch, for weights and for token files alike."""
    data = b"weights" * 1000
    tokens = (np.arange(500, dtype="<u2") * 3).tobytes()
    for torn in (data[:100], b""):
        cache = BlobCache(tmp_path)
        cache.put(sha(data), data)
        cache.put(sha(tokens), tokens)
        cache.path(sha(data)).write_bytes(torn)
        cache.path(sha(tokens)).write_bytes(tokens[: len(torn)])
        after = BlobCache(tmp_path)  # the island started again
        assert after.get_or_fetch(sha(data), lambda: data) == data
        np.testing.assert_array_equal(after.tokens(sha(tokens), lambda: tokens), np.frombuffer(tokens, dtype="<u2"))
        assert after.misses == 2 and after.hits == 0


def test_tokens_are_memory_mapped_little_endian_and_cached(tmp_path: Path) -> None:
    cache = BlobCache(tmp_path)
    tokens = np.arange(1000, dtype="<u2") * 7
    data = tokens.tobytes()
    calls: list[int] = []

    def fetch() -> bytes:
        calls.append(1)
        return data

    first = cache.tokens(sha(data), fetch)
    assert isinstance(first, np.memmap) and first.dtype == np.dtype("<u2")
    np.testing.assert_array_equal(first[10:20], tokens[10:20])
    second = BlobCache(tmp_path).tokens(sha(data), fetch)  # a new process: verified again, not fetched
    np.testing.assert_array_equal(second, tokens)
    assert len(calls) == 1


def test_rejects_names_that_are_not_hashes(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="sha256"):
        BlobCache(tmp_path).path("../../etc/passwd")
