"""Lease dispatch: which island gets which path, when a waiting island wakes, and the background sweep.

`LeaseDispatcher.next_lease` answers one lease request. Each attempt looks for work in this order:
1. an offer this process's round apply made to the island (`OfferBook`): taken up in a batch, no other read;
2. nothing, without touching the database, when nothing changed since the island last found no work
   (`WorkSignal.nothing_new`);
3. the database (`leases.take_offer`, then `leases.acquire_lease`); when no path is free and a round is past its
   deadline, that round may close on quorum now (`RoundCloser`), and its successor has work.
With `wait_s`, a request that found nothing sleeps on the `WorkSignal` until something changes or the time is
up, then tries again. `sweep` is the background pass: expire leases, close due rounds, notice changes made by
other processes (and when a round opened, put its offers in the `OfferBook`: an `apply-worker` or another worker
made them, and its islands are about to ask at once).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from coordinator.batching import GroupCommit
from coordinator.blobstore import S3BlobStore
from coordinator.db import reading, start_writing
from coordinator.metrics import Metrics
from coordinator.offer_book import OfferBook
from coordinator.schemas import IdleReason, LeaseModule, LeaseModules, LeasePublic
from coordinator.services import leases
from coordinator.services.closing import RoundCloser
from coordinator.services.leases import Affinity, OpenRound
from coordinator.wakeups import WorkSignal

MAX_LEASE_ATTEMPTS = 4
"""Lease attempts that look in the database at once per process: they serialise on the run row anyway, and the
threads they would hold are better left to heartbeats and uploads when a round opens and every island asks at
once."""


@dataclass(frozen=True, slots=True)
class Dispatched:
    """The answer to one lease request: a lease, or why there is none; and how long it was held waiting."""

    lease: LeasePublic | None
    idle: IdleReason | None
    """None when `lease` is set."""
    held_s: float


@dataclass(frozen=True, slots=True)
class _Found:
    lease: LeasePublic | None
    idle: IdleReason | None
    until: datetime | None = None
    """No work: time alone frees nothing before this (None: only an event can; see `leases.next_change`)."""


class LeaseDispatcher:
    """Hands out leases for this process (see the module docstring)."""

    def __init__(
        self,
        *,
        sessions: sessionmaker[Session],
        clock: Callable[[], datetime],
        closer: RoundCloser,
        offers: OfferBook,
        wakeups: WorkSignal,
        metrics: Metrics,
        affinity: Affinity,
        max_leases: int = 1,
        direct: S3BlobStore | None = None,
        presign_expiry_s: float = 900.0,
    ) -> None:
        self._sessions = sessions
        self._clock = clock
        self._closer = closer
        self._offers = offers
        self._wakeups = wakeups
        self._metrics = metrics
        self._affinity = affinity
        self._max_leases = max_leases
        self._direct = direct
        """With an s3:// store, leases carry pre-signed URLs and islands move the bytes themselves."""
        self._presign_expiry_s = presign_expiry_s
        """Leases one island may hold at once (its capabilities may ask for fewer)."""
        self._slots = asyncio.Semaphore(MAX_LEASE_ATTEMPTS)
        self._take_ups = GroupCommit(self._take_up)
        """Offers from the book taken up in batches: requests that arrive while one batch's UPDATE runs join the
        next one."""
        self._newest_round: int | None = -1
        """The newest round id the sweep saw (-1: none yet); a new one makes it adopt the database's offers."""

    @property
    def affinity(self) -> Affinity:
        """How paths stay with the island that trained them (offers, reservations)."""
        return self._affinity

    async def next_lease(self, island_id: int, *, wait_s: float) -> Dispatched:
        """Work for the island: an offer made to it when the last round closed, else a free path of a running
        run. With `wait_s` > 0 the request is held until work appears or the time is up; when no run is running
        the answer comes at once (an island may want to leave then)."""
        until = time.monotonic() + wait_s
        held = 0.0
        while True:
            ticket = self._wakeups.ticket()  # a change while this attempt runs wakes the wait below at once
            found = await self._attempt(island_id, ticket)
            left = until - time.monotonic()
            if found.lease is not None or left <= 0 or found.idle == "no-running-runs":
                lease = self.with_urls(found.lease) if found.lease is not None else None
                return Dispatched(lease=lease, idle=found.idle, held_s=held)
            started = time.monotonic()
            await self._wakeups.wait(ticket, left)
            held += time.monotonic() - started

    async def lease_modules(self, lease_id: int, island_id: int, *, wait_s: float) -> LeaseModules:
        """The modules of the island's pending lease at its base versions (`leases.lease_modules`); with `wait_s`
        the request is held until they are all stepped or the time is up (a committed step wakes it)."""
        until = time.monotonic() + wait_s
        while True:
            ticket = self._wakeups.ticket()
            found = await run_in_threadpool(self._lease_modules, lease_id, island_id)
            left = until - time.monotonic()
            if found.ready or left <= 0:
                return found.model_copy(update={"modules": self._module_urls(found.modules)})
            await self._wakeups.wait(ticket, left)

    def _lease_modules(self, lease_id: int, island_id: int) -> LeaseModules:
        with reading(), self._sessions() as session:
            found = leases.lease_modules(session, lease_id, island_id)
            session.rollback()
        return found

    def _module_urls(self, modules: list[LeaseModule]) -> list[LeaseModule]:
        """Modules with pre-signed GETs of their weights (s3:// stores only; not for versions still pending)."""
        if self._direct is None:
            return modules
        expiry = self._presign_expiry_s
        return [
            m
            if m.weights_hash is None
            else m.model_copy(update={"url": self._direct.presign_get(m.weights_hash, expires_s=expiry)})
            for m in modules
        ]

    def with_urls(self, lease: LeasePublic) -> LeasePublic:
        """The lease with pre-signed GETs of its modules, shard and held-out slice, and direct upload on (s3://
        stores only)."""
        if self._direct is None:
            return lease
        expiry = self._presign_expiry_s
        modules = self._module_urls(lease.modules)
        shard = lease.shard.model_copy(
            update={"url": self._direct.presign_get(lease.shard.tokens_hash, expires_s=expiry)}
        )
        heldout = lease.heldout
        if heldout is not None:
            heldout = heldout.model_copy(
                update={"url": self._direct.presign_get(heldout.tokens_hash, expires_s=expiry)}
            )
        return lease.model_copy(update={"modules": modules, "shard": shard, "heldout": heldout, "direct_upload": True})

    async def _attempt(self, island_id: int, ticket: asyncio.Event | None) -> _Found:
        """One look for work: an offer this process built (no read), else the database, unless nothing changed
        since the island last found nothing there."""
        offer = self._offers.pop(island_id, now=self._clock())
        if offer is not None:
            taken = await self._take_ups.submit(offer)
            if taken is not None:
                self._metrics.leases_issued.inc()
                return _Found(taken, None)
        elif self._wakeups.nothing_new(island_id, self._clock()):
            return _Found(None, "waiting")
        async with self._slots:
            found = await run_in_threadpool(self._from_database, island_id)
        if found.lease is None and found.idle == "waiting":
            self._wakeups.remember_idle(island_id, ticket, found.until)
        return found

    def _take_up(self, offers: list[leases.ReadyOffer]) -> list[LeasePublic | None]:
        with self._sessions() as session:
            return leases.take_up_offers(session, offers, now=self._clock())

    def _from_database(self, island_id: int) -> _Found:
        """A pending offer from the database (made by another process, or before a restart), else a free path."""
        now = self._clock()
        # a reader until it finds something to write (`db.start_writing`): on SQLite, islands that find no work
        # never take the write lock, which uploads and module steps wait for
        with reading(), self._sessions() as session:
            offered = leases.take_offer(session, island_id, now=now)
            if offered is not None:
                found = _Found(offered, None)
            else:
                try:
                    found = self._free_path(session, island_id, now=now)
                except leases.OfferPending:
                    # a round closed after the look above and offered this island a path: that is its answer
                    offered = leases.take_offer(session, island_id, now=now)
                    found = _Found(offered, None) if offered is not None else _Found(None, "waiting", now)
            session.rollback()
        if offered is not None:  # its apply may hand the book this offer only now: it must not stay there
            self._offers.taken(island_id, offered.lease_id, until=offered.expires_at)
        if found.lease is not None:
            self._metrics.leases_issued.inc()
        return found

    def _free_path(self, session: Session, island_id: int, *, now: datetime) -> _Found:
        """A free path of an open round; when there is none, a round past its deadline may close on quorum now
        (its successor opens once the apply executors have stepped its modules)."""
        found = self._lease_open_rounds(session, island_id, now=now)
        if found.lease is None and found.idle == "waiting" and found.due:
            start_writing(session)
            self._closer.close_ready(session, found.due, now=now)
        return _Found(found.lease, found.idle, found.until)

    def _lease_open_rounds(self, session: Session, island_id: int, *, now: datetime) -> _Search:
        rounds = leases.open_rounds(session)
        if not rounds:
            return _Search(None, "no-running-runs")
        issued, expired = leases.acquire_lease(
            session, island_id, rounds, now=now, affinity=self._affinity, max_leases=self._max_leases
        )
        self._metrics.lease_expiries.inc(expired)
        if issued is not None:
            return _Search(issued, None)
        until = leases.next_change(session, rounds, now=now, affinity=self._affinity)
        return _Search(None, "waiting", until, due=_past_deadline(rounds, now))

    def sweep(self) -> None:
        """The background pass: expire stale leases, close rounds that are complete or past their deadline with
        a quorum, and wake waiting requests when the database shows changes made by another process."""
        now = self._clock()
        with self._sessions() as session:
            self._metrics.lease_expiries.inc(leases.expire_stale_leases(session, now=now))
            session.commit()
            self._closer.close_ready(session, None, now=now)
            signature = leases.work_signature(session, now=now, reserve_s=self._affinity.reserve_s)
            if signature[0] != self._newest_round:
                # a round opened (or this process just started): its offers into the book before the waiting
                # islands wake, so that they are taken up in batches, not one transaction each (`take_offer`)
                self._offers.put(leases.pending_offers(session, now=now, known=self._offers.known()), now=now)
                self._newest_round = signature[0]
            self._wakeups.notify_if_changed(signature)
            session.rollback()


@dataclass(frozen=True, slots=True)
class _Search(_Found):
    due: list[int] | None = None
    """Runs whose open round is past its deadline (it may close on quorum)."""


def _past_deadline(rounds: list[OpenRound], now: datetime) -> list[int]:
    return [r.run_id for r in rounds if r.open and r.deadline is not None and now >= r.deadline]
