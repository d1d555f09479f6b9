"""Streaming a request body to a temporary file while it arrives (outer-gradient and shard uploads).

The event loop only receives and coalesces chunks; hashing (sha256, the blob's name) and writing run on a
thread of their own, both releasing the GIL, so receiving overlaps them (docs/LOG.md, upload fast path). An
upload that names its own sha256 is not hashed here (`digest=False`): the apply executor checks it
(services/staging.py).
"""

from __future__ import annotations

import asyncio
import hashlib
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

from coordinator.errors import PayloadTooLarge


@dataclass(frozen=True, slots=True)
class Spooled:
    """A request body on local disk, with its sha256 computed while it streamed in (None when not asked for)."""

    path: Path
    sha256: str | None
    size: int


SPOOL_BUFFER = 1 << 20
"""Body chunks (64-256 KiB each from uvicorn) are joined into buffers of about this size before the spool thread
gets them: one hash and one write call per MiB, each releasing the GIL long enough to be worth it."""
SPOOL_IN_FLIGHT = 8
"""Buffers handed to the spool thread and not yet written: one upload holds at most ~8 MiB of memory."""
SPOOL_FLUSH_EVERY = 32 << 20
"""After every this many bytes the spool thread starts writing the file back to disk on a helper thread, without
waiting for it, so the fsync that makes an accepted upload durable (`BlobStore.put_file`) finds little left to
do: ~50 ms less per 90 MB upload here (docs/LOG.md, 2026-11-30 upload fast path)."""


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


async def spool_body(request: Request, *, limit: int, spool_dir: Path, digest: bool = True) -> Spooled:
    """Stream the request body to a temporary file, refusing more than `limit` bytes; `digest`: hash it too.

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
                    writer, fd_open = _SpoolThread(fd, name, digest=digest), False
                await writer.put(b"".join(pending))  # join of one item returns it as is
                pending, pending_size = [], 0
        rest = b"".join(pending)
        if writer is None:  # under one buffer: well under a millisecond of work, no thread needed
            _write_all(fd, rest)
            fd_open = False
            os.close(fd)
            sha256 = hashlib.sha256(rest).hexdigest() if digest else None
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
    return Spooled(path=Path(name), sha256=sha256, size=size)


class _SpoolThread:
    """Hashes and writes one body into an open file on a thread of its own, fed through a bounded hand-off.

    The thread owns the descriptor and closes it; it removes the file when aborted or when a write or flush
    fails. `put` raises the thread's error (e.g. disk full) at the next buffer, `finish` at the end; the caller
    then aborts.
    """

    def __init__(self, fd: int, path: str, *, digest: bool) -> None:
        self._fd = fd
        self._digest = digest
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
                        _write_all(self._fd, buf)
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
            ended = True
        finally:
            if flusher is not None:
                flusher.join()
            # A flush error must fail the upload: a later fsync on another descriptor may not report it again.
            self._error = self._error or self._flush_error
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

    def _failed(self, error: Exception) -> OSError:
        failed = OSError(f"spooling the request body to {self._path} failed: {error!r}")
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
