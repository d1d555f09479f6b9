"""Waking lease requests that wait for work (long polling).

An island that finds no free path may ask the coordinator to hold its lease request for up to `?wait=` seconds
instead of polling. Held requests sleep on a `WorkSignal` and try again when it fires:
- at once, when this process applied a round, a lease was released or an island left (`notify`);
- within a sweep interval, when another process (a second worker or replica on the same database) did any of
  that: the sweeper compares a cheap signature of the database, the newest round and the number of leases
  that expired or were given back (`notify_if_changed`).
An idle island therefore costs nothing between changes, and starts the moment a round opens.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Hashable

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from coordinator.models import Lease, Round


class WorkSignal:
    """A broadcast wake-up: `notify()` from any thread; `wait(timeout)` from the event loop."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event: asyncio.Event | None = None
        self._signature: Hashable | None = None
        self._lock = threading.Lock()

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

    async def wait(self, ticket: asyncio.Event | None, timeout: float) -> None:
        """Return on the first notification after `ticket` was taken, or after `timeout` seconds."""
        if ticket is None or timeout <= 0:
            return
        try:
            await asyncio.wait_for(ticket.wait(), timeout)
        except TimeoutError:
            pass


def work_signature(session: Session) -> tuple[int | None, int]:
    """Changes here can free a path: a round opened (newest round id), a lease expired or was released."""
    newest_round = session.scalar(select(func.max(Round.id)))
    given_back = session.scalar(
        select(func.count()).select_from(Lease).where(Lease.status.in_(("expired", "released")))
    )
    return newest_round, int(given_back or 0)
