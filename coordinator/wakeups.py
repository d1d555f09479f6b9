"""Waking lease requests that wait for work (long polling).

An island that finds no free path may ask the coordinator to hold its lease request for up to `?wait=` seconds
instead of polling. Held requests sleep on a `WorkSignal` and try again when it fires:
- at once, when this process applied a round, a lease was released, an island left or a run started
  (`notify`);
- within a sweep interval, when another process (a second worker or replica on the same database) did any of
  that: the sweeper compares a cheap signature of the database (`services.leases.work_signature`) with the last
  one (`notify_if_changed`).
An idle island therefore costs nothing between changes, and starts the moment a round opens: a lease request
that found nothing skips the database on its next try until some notification came (`remember_idle`).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Hashable
from datetime import datetime


class WorkSignal:
    """A broadcast wake-up: `notify()` from any thread; `wait(timeout)` from the event loop."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event: asyncio.Event | None = None
        self._signature: Hashable | None = None
        self._lock = threading.Lock()
        self._idle: dict[int, tuple[asyncio.Event | None, datetime | None]] = {}

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Attach to the server's event loop (at start-up); before that, notifications are dropped."""
        self._loop = loop
        self._event = asyncio.Event()

    def notify(self) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._fire)

    def notify_if_changed(self, signature: Hashable) -> None:
        """Notify when `signature` differs from the one seen last (the first one only records)."""
        with self._lock:
            changed = self._signature is not None and signature != self._signature
            self._signature = signature
        if changed:
            self.notify()

    def _fire(self) -> None:
        if self._event is not None:
            self._event.set()
            self._event = asyncio.Event()  # later waiters wait for the next change

    def ticket(self) -> asyncio.Event | None:
        """Take before looking for work; `wait(ticket, ...)` then also sees a notification that came meanwhile."""
        return self._event

    def remember_idle(self, island_id: int, ticket: asyncio.Event | None, until: datetime | None) -> None:
        """The island found no work in an attempt that started at `ticket`, and time alone frees nothing before
        `until` (None: never; see `leases.next_change`). Event loop only."""
        self._idle[island_id] = (ticket, until)

    def nothing_new(self, island_id: int, now: datetime) -> bool:
        """True while asking again would find no work: no notification since the island last found none, and
        nothing it waited on ran out."""
        ticket, until = self._idle.get(island_id, (None, None))
        return ticket is not None and not ticket.is_set() and (until is None or now < until)

    async def wait(self, ticket: asyncio.Event | None, timeout: float) -> None:
        """Return on the first notification after `ticket` was taken, or after `timeout` seconds."""
        if ticket is None or timeout <= 0:
            return
        try:
            await asyncio.wait_for(ticket.wait(), timeout)
        except TimeoutError:
            pass
