"""Streaming a request body to a temporary file while it arrives (outer-gradient and shard uploads).

The event loop only receives and coalesces chunks; hashing (sha256, the blob's name), writing and checking the
values of a large outer gradient (`services.payloads.PayloadStream`) run on a thread of their own, all releasing
the GIL, so receiving overlaps them (docs/LOG.md, upload fast path). A large upload that names its own sha256 is
not hashed here (`digest=False`): the apply executor checks it (services/staging.py).
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import mmap
import os
import queue
import shutil
import socket
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fastapi import Request
from fastapi.concurrency import run_in_threadpool

from coordinator.errors import PayloadTooLarge


@dataclass(slots=True)
class Spooled:
    """A request body on local disk, with its sha256 computed while it streamed in (None when not asked for)."""

    path: Path
    sha256: str | None
    size: int
    unsynced: int | None = None
    """A small body's file, still open and not yet synced (`spool_body(defer_sync=True)`): `sync` it on the worker
    thread that goes on to take the request's locks; `close` it in any case."""

    def sync(self) -> None:
        """Make the body durable (nothing when it is already) and close its descriptor; `SpoolError` on failure."""
        if self.unsynced is None:
            return
        try:
            os.fsync(self.unsynced)
        except OSError as exc:
            raise SpoolError(f"spooling the request body to {self.path} failed: {exc!r}") from exc
        finally:
            self.close()

    def close(self) -> None:
        if self.unsynced is not None:
            fd, self.unsynced = self.unsynced, None
            os.close(fd)


SPOOL_BUFFER = 1 << 20
"""Body chunks (64-256 KiB each from uvicorn) are joined into buffers of about this size before the spool thread
gets them: one hash and one write call per MiB, each releasing the GIL long enough to be worth it."""
SPOOL_IN_FLIGHT = 8
"""Buffers handed to the spool thread and not yet written: one upload holds at most ~8 MiB of memory."""
SPOOL_FLUSH_EVERY = 32 << 20
"""After every this many bytes the spool thread starts writing the file back to disk on a helper thread, without
waiting for it, so the fsync that ends the spool (the body durable before the upload takes its locks;
`BlobStore.put_file` then finds nothing left to flush) has little left to do: ~50 ms less per 90 MB upload here
(docs/LOG.md, 2026-11-30 upload fast path)."""


ALIGN = 4096
"""O_DIRECT writes start and end on multiples of this (the page size; covers the logical block size of the disks
seen here)."""
_direct_broken = False
"""Set when a direct write failed with EINVAL although the open succeeded: this process spools through the page
cache from then on."""


class SpoolError(OSError):
    """Writing or syncing a request body to the spool failed (disk full, an I/O error): the request fails with a
    500 (the island retries it) and nothing of it stays."""


class _DirectWriter:
    """Appends to a file through O_DIRECT, past the page cache, from one page-aligned buffer; the last partial block
    is written padded with zeros and the file then cut to its size. Why: on this VM a write that needs fresh
    page-cache pages runs at ~450 MB/s, a direct one at ~2 GB/s (docs/LOG.md, 2026-12-02 and 2026-12-04)."""

    CAPACITY = 2 * SPOOL_BUFFER

    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_WRONLY | getattr(os, "O_DIRECT", 0))  # EINVAL where the filesystem refuses
        self._buf = mmap.mmap(-1, self.CAPACITY)  # anonymous maps are page-aligned
        self._view = memoryview(self._buf)
        self._fill = 0
        self._written = 0
        self.size = 0

    @staticmethod
    def open(path: str) -> _DirectWriter | None:
        """A direct writer of `path`, or None where the platform or filesystem has no O_DIRECT."""
        if _direct_broken or not hasattr(os, "O_DIRECT"):
            return None
        try:
            return _DirectWriter(path)
        except OSError:  # a filesystem without direct I/O (older tmpfs, some FUSE ones)
            return None

    def write(self, data: bytes) -> None:
        src = memoryview(data)
        while src:
            n = min(len(src), self.CAPACITY - self._fill)
            self._view[self._fill : self._fill + n] = src[:n]
            self._fill += n
            self.size += n
            src = src[n:]
            whole = self._fill // ALIGN * ALIGN
            if whole and (self._fill == self.CAPACITY or not src):
                self._write(self._view[:whole])
                rest = self._fill - whole
                self._view[:rest] = self._view[whole : self._fill]  # rest < ALIGN <= whole: no overlap
                self._fill = rest

    def close(self, plain_fd: int) -> None:
        """Write the tail; cut the file to its size through `plain_fd` (a buffered descriptor of the same file)."""
        try:
            if self._fill:
                padded = -(-self._fill // ALIGN) * ALIGN
                self._view[self._fill : padded] = bytes(padded - self._fill)
                self._write(self._view[:padded])
                os.ftruncate(plain_fd, self.size)
        finally:
            self.release()

    def release(self) -> None:
        os.close(self._fd)
        try:
            self._view.release()
            self._buf.close()
        except BufferError:  # a slice is still referenced (by a failed write's traceback): freed when it goes
            pass

    def _write(self, view: memoryview) -> None:
        global _direct_broken
        while view:
            try:
                n = os.write(self._fd, view)
            except OSError as exc:
                if exc.errno == errno.EINVAL and self._written == 0:
                    _direct_broken = True  # the filesystem took the open, not the write: the next are buffered
                raise
            if n % ALIGN:  # the rest would start off the block boundary
                raise OSError(errno.EIO, f"short direct write of {n} bytes at {self._written}")
            self._written += n
            view = view[n:]


def process_spool(root: Path) -> Path:
    """This process's own spool directory under `root` (`<host>-<pid>`), after removing the directories of this
    host's processes that are gone: what a crashed or killed coordinator left half-received. Workers and
    replicas that share a data directory each keep to their own, so none removes another's live uploads."""
    host = socket.gethostname()
    root.mkdir(parents=True, exist_ok=True)
    for leftover in root.iterdir():
        owner, _, pid = leftover.name.rpartition("-")
        if leftover.is_dir() and owner == host and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(leftover, ignore_errors=True)
        elif leftover.is_file() and leftover.suffix == ".upload":  # the flat layout of earlier versions
            leftover.unlink(missing_ok=True)
    mine = root / f"{host}-{os.getpid()}"
    mine.mkdir(exist_ok=True)
    return mine


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


async def spool_body(
    request: Request,
    *,
    limit: int,
    spool_dir: Path,
    digest: bool = True,
    check: Callable[[bytes], None] | None = None,
    direct: bool = False,
    defer_sync: bool = False,
) -> Spooled:
    """Stream the request body to a temporary file, refusing more than `limit` bytes; `digest`: hash it too;
    `check`: also hand it every buffer once written, in order, on the same thread (it must not raise);
    `direct`: write a body of more than one buffer with O_DIRECT where the filesystem allows it (`_DirectWriter`);
    `defer_sync`: a body under one buffer is returned unsynced, its descriptor open (`Spooled.sync`), for the
    caller to sync on the worker thread it runs the request's transaction on, instead of on one more worker thread
    here: under load every hop to anyio's worker threads waits its turn (docs/LOG.md, 2026-12-05).

    The event loop only receives and joins chunks. From the first full buffer on, hashing and writing run on a
    thread of their own (`_SpoolThread`; both release the GIL), so receiving the next bytes overlaps them; a body
    smaller than one buffer is hashed and written in place. On any error, the client going away included, the
    temporary file is removed and the thread has ended before this raises.
    """
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"body of {int(declared)} bytes is over the {limit}-byte limit")
    fd, name = tempfile.mkstemp(dir=spool_dir, suffix=".upload")
    fd_open = True  # until the thread takes the descriptor over, or a small body closed it
    writer: _SpoolThread | None = None
    size = 0
    pending: list[bytes] = []
    pending_size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(f"body is over the {limit}-byte limit")
            pending.append(chunk)
            pending_size += len(chunk)
            if pending_size >= SPOOL_BUFFER:
                if writer is None:
                    writer, fd_open = _SpoolThread(fd, name, digest=digest, check=check, direct=direct), False
                await writer.put(b"".join(pending))  # join of one item returns it as is
                pending, pending_size = [], 0
        rest = b"".join(pending)
        unsynced = None
        if writer is None:  # under one buffer: well under a millisecond of work, no thread needed
            try:  # durable before the upload takes its locks; synced on a worker thread: it takes milliseconds
                _write_all(fd, rest)
                if not defer_sync:
                    await run_in_threadpool(os.fsync, fd)
            except OSError as exc:
                raise SpoolError(f"spooling the request body to {name} failed: {exc!r}") from exc
            sha256 = hashlib.sha256(rest).hexdigest() if digest else None
            if check is not None:
                check(rest)
            fd_open = False
            if defer_sync:
                unsynced = fd
            else:
                os.close(fd)
        else:
            if rest:
                await writer.put(rest)
            sha256 = await writer.finish()
    except BaseException:
        if writer is not None:
            await writer.abort()
        elif fd_open:
            os.close(fd)
        Path(name).unlink(missing_ok=True)
        raise
    return Spooled(path=Path(name), sha256=sha256, size=size, unsynced=unsynced)


class _SpoolThread:
    """Hashes and writes one body into an open file on a thread of its own, fed through a bounded hand-off.

    The thread owns the descriptor and closes it; it removes the file when aborted or when a write or flush
    fails. `put` raises the thread's error (e.g. disk full) at the next buffer, `finish` at the end; the caller
    then aborts.
    """

    def __init__(
        self,
        fd: int,
        path: str,
        *,
        digest: bool,
        check: Callable[[bytes], None] | None = None,
        direct: bool = False,
    ) -> None:
        self._fd = fd
        self._digest = digest
        self._check = check
        self._direct = _DirectWriter.open(path) if direct else None
        self._path = path
        self._loop = asyncio.get_running_loop()
        self._slots = asyncio.Semaphore(SPOOL_IN_FLIGHT)  # released by the thread as it finishes each buffer
        self._queue: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._aborted = threading.Event()
        self._error: Exception | None = None
        self._flush_error: OSError | None = None
        self._done: asyncio.Future[str | None] = self._loop.create_future()
        self._thread = threading.Thread(target=self._run, name=f"dipaco-spool-{os.path.basename(path)}", daemon=True)
        self._thread.start()

    async def put(self, buf: bytes) -> None:
        await self._slots.acquire()
        if self._error is not None:
            raise self._failed(self._error)
        self._queue.put(buf)

    async def finish(self) -> str | None:
        """Wait until everything handed over is written; the body's sha256 (None when not hashing)."""
        self._queue.put(None)
        return await asyncio.shield(self._done)  # a cancelled request still aborts and waits, see abort

    async def abort(self) -> None:
        """Stop writing, remove the file and wait for the thread to end."""
        self._aborted.set()
        self._queue.put(None)
        await asyncio.wait([self._done])
        if not self._done.cancelled():
            self._done.exception()  # marks it retrieved: the caller raises its own error

    def _run(self) -> None:
        digest = hashlib.sha256() if self._digest else None
        written = flushed = 0
        flusher: threading.Thread | None = None
        ended = False
        try:
            while (buf := self._queue.get()) is not None:
                try:
                    if self._error is None and not self._aborted.is_set():
                        if digest is not None:
                            digest.update(buf)
                        if self._direct is not None:
                            self._direct.write(buf)
                        else:
                            _write_all(self._fd, buf)
                        if self._check is not None:
                            self._check(buf)
                        written += len(buf)
                        if written - flushed >= SPOOL_FLUSH_EVERY and (flusher is None or not flusher.is_alive()):
                            # not inline: appends wait while a flush commits, the next bytes arrive meanwhile
                            flusher = threading.Thread(
                                target=self._flush, name=f"{self._thread.name}-flush", daemon=True
                            )
                            flusher.start()
                            flushed = written
                except Exception as exc:  # handed to the event loop at the next put, or by finish
                    self._error = exc
                finally:
                    self._notify(self._slots.release)
            if self._direct is not None and self._error is None and not self._aborted.is_set():
                try:
                    self._direct.close(self._fd)
                except Exception as exc:
                    self._error = exc
                self._direct = None
            ended = True
        finally:
            if self._direct is not None:
                self._direct.release()
            if flusher is not None:
                flusher.join()
            # A flush error must fail the upload: a later fsync on another descriptor may not report it again.
            self._error = self._error or self._flush_error
            if ended and self._error is None and not self._aborted.is_set():
                try:  # durable here, before the upload takes its locks: `put_file`'s fsync then has nothing to do
                    os.fsync(self._fd)
                except OSError as exc:
                    self._error = exc
            if not ended and self._error is None:
                self._error = RuntimeError("the spool thread stopped early")
            os.close(self._fd)
            if self._error is not None or self._aborted.is_set():
                Path(self._path).unlink(missing_ok=True)
            self._notify(self._settle, None if digest is None else digest.hexdigest(), self._error)

    def _flush(self) -> None:
        try:
            _datasync(self._fd)
        except OSError as exc:
            self._flush_error = exc

    def _settle(self, digest: str | None, error: Exception | None) -> None:
        if error is None:
            self._done.set_result(digest)
        else:
            self._done.set_exception(self._failed(error))

    def _failed(self, error: Exception) -> SpoolError:
        failed = SpoolError(f"spooling the request body to {self._path} failed: {error!r}")
        failed.__cause__ = error
        return failed

    def _notify(self, callback: Callable[..., object], *args: object) -> None:
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the event loop is closed: nobody is waiting any more
            pass


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


_datasync: Callable[[int], None] = getattr(os, "fdatasync", os.fsync)  # macOS has no fdatasync
