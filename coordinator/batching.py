"""Group commit for requests that each need a small transaction: the requests that arrive while one batch runs
on a worker thread join the next one, so N requests at once cost a few transactions instead of N.

At low load a batch holds one request and costs what the request alone did; under load the batches grow and the
cost per request falls, which is when it matters. Used by the dispatcher's offer take-ups (a round opening wakes every
island at once) and by heartbeats (the most frequent request).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Generic, TypeVar

from starlette.concurrency import run_in_threadpool

T = TypeVar("T")
R = TypeVar("R")


class GroupCommit(Generic[T, R]):
    """`run(items)` runs one batch on a worker thread and returns one result per item, in order. Event loop only.

    An exception from `run` reaches every request of its batch, and the next batch runs as usual. A request
    cancelled while it waits (its client went away) does not cancel its batch: the others still get their
    results."""

    def __init__(self, run: Callable[[list[T]], list[R]]) -> None:
        self._run = run
        self._queue: list[tuple[T, asyncio.Future[R]]] = []
        self._drain: asyncio.Task[None] | None = None

    def waiting(self) -> int:
        """Requests queued for the next batch (not those of the batch running now)."""
        return len(self._queue)

    async def submit(self, item: T) -> R:
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._queue.append((item, future))
        if self._drain is None:
            self._drain = asyncio.create_task(self._drain_queue())
        return await future

    async def _drain_queue(self) -> None:
        try:
            while self._queue:
                batch, self._queue = self._queue, []
                try:
                    results = await run_in_threadpool(self._run, [item for item, _ in batch])
                except Exception as exc:  # noqa: BLE001 - every waiter gets the error
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(exc)
                    continue
                for (_, future), result in zip(batch, results, strict=True):
                    if not future.done():
                        future.set_result(result)
        finally:
            self._drain = None
