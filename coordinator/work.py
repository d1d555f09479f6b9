"""Waking lease requests that wait for work (long polling).

An island that finds no free path may ask the coordinator to hold its lease request for up to `?wait=` seconds
instead of polling. Held requests sleep on a `WorkSignal` and try again when it fires:
- at once, when this process applied a round, a lease was released or an island left (`notify`);
- within a sweep interval, when another process (a second worker or replica on the same database) did any of
  that: the sweeper compares a cheap signature of the database, the newest round and the number of leases
  that expired or were given back (`notify_if_changed`).
An idle island therefore costs nothing between changes, and starts the moment a round opens: a lease request
that found nothing skips the database on its next try until some notification came (`remember_idle`).

When a round opens, every island asks at once. The apply builds each offer's lease view as it makes the offer
(`OfferBook`), and the take-ups of a burst share one UPDATE per batch, so N islands waking together cost a few
statements instead of N transactions.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Hashable, Iterable
from datetime import datetime, timedelta

from sqlalchemy import func, select
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from coordinator.models import Lease, Round
from coordinator.schemas import LeasePublic
from coordinator.services.leases import ReadyOffer
from coordinator.timeutil import as_utc


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


def work_signature(session: Session, *, now: datetime, reserve_s: float) -> tuple[int | None, int, int]:
    """Changes here can free a path: a round opened (newest round id), a lease expired or was released, a
    round's reservation window ended (paths kept for other islands become free to all)."""
    newest_round = session.scalar(select(func.max(Round.id)))
    given_back = session.scalar(
        select(func.count()).select_from(Lease).where(Lease.status.in_(("expired", "released")))
    )
    reserving = session.scalar(
        select(func.count())
        .select_from(Round)
        .where(Round.status == "open", Round.opened_at >= now - timedelta(seconds=reserve_s))
    )
    return newest_round, int(given_back or 0), int(reserving or 0)


class OfferBook:
    """Offers made by this process's round applies, with their lease views, until their islands ask.

    Take-ups are grouped: while one batch's UPDATE runs on a worker thread, requests arriving meanwhile queue for
    the next one. An offer this book does not hold (another worker made it, or this process restarted) is taken
    up from the database (`leases.take_offer`), as is one the batch could not take.
    """

    def __init__(self) -> None:
        self._ready: dict[int, ReadyOffer] = {}
        self._lock = threading.Lock()
        self._queue: list[tuple[ReadyOffer, asyncio.Future[LeasePublic | None]]] = []
        self._drain: asyncio.Task[None] | None = None

    def put(self, offers: Iterable[ReadyOffer], *, now: datetime) -> None:
        """Hold committed offers (any thread); offers that ran out are dropped on the way."""
        with self._lock:
            self._ready = {i: o for i, o in self._ready.items() if as_utc(o.lease.expires_at) >= now}
            self._ready.update((offer.island_id, offer) for offer in offers)

    def pop(self, island_id: int, *, now: datetime) -> ReadyOffer | None:
        with self._lock:
            offer = self._ready.pop(island_id, None)
        return offer if offer is not None and as_utc(offer.lease.expires_at) >= now else None

    def __len__(self) -> int:
        return len(self._ready)

    async def take_up(
        self, offer: ReadyOffer, take: Callable[[list[ReadyOffer]], list[LeasePublic | None]]
    ) -> LeasePublic | None:
        """The offer as an active lease, or None when it could not be taken; `take` runs one batch (a thread)."""
        future: asyncio.Future[LeasePublic | None] = asyncio.get_running_loop().create_future()
        self._queue.append((offer, future))
        if self._drain is None:
            self._drain = asyncio.create_task(self._run(take))
        return await future

    async def _run(self, take: Callable[[list[ReadyOffer]], list[LeasePublic | None]]) -> None:
        try:
            while self._queue:
                batch, self._queue = self._queue, []
                try:
                    results = await run_in_threadpool(take, [offer for offer, _ in batch])
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
