"""Offers made by this process's round applies, held with their lease views until their islands ask.

When a round opens, every island asks at once. The apply builds each offer's lease view as it makes the offer,
and the dispatcher takes the offers of a burst up in batches, one UPDATE each (`services.leases.take_up_offers`
through `batching.GroupCommit`), so N islands waking together cost a few statements instead of N transactions.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from datetime import datetime

from coordinator.services.leases import ReadyOffer
from coordinator.timeutil import as_utc


class OfferBook:
    """Offers made by this process's round applies, with their lease views, until their islands ask.

    An offer this book does not hold (another worker made it, or this process restarted) is taken up from the
    database (`leases.take_offer`), as is one the dispatcher's batch could not take.
    """

    def __init__(self) -> None:
        self._ready: dict[int, ReadyOffer] = {}
        self._seen: dict[int, datetime] = {}
        """lease id -> expiry of every offer put or taken from the database and not yet run out (`put` skips
        them: holding one again would only cost its island a failed take-up later)."""
        self._lock = threading.Lock()

    def put(self, offers: Iterable[ReadyOffer], *, now: datetime) -> int:
        """Hold committed offers (any thread), except those this book held or saw taken before: the apply that
        made them and the sweep (reading the database) may both put one, in either order, and its island may have
        taken it up in between. Offers that ran out are dropped on the way. Returns how many were new."""
        with self._lock:
            self._ready = {i: o for i, o in self._ready.items() if as_utc(o.lease.expires_at) >= now}
            self._seen = {i: at for i, at in self._seen.items() if at >= now}
            fresh = [offer for offer in offers if offer.lease_id not in self._seen]
            for offer in fresh:
                self._ready[offer.island_id] = offer
                self._seen[offer.lease_id] = as_utc(offer.lease.expires_at)
            return len(fresh)

    def taken(self, island_id: int, lease_id: int, *, until: datetime) -> None:
        """The island took offer `lease_id` up from the database (`leases.take_offer`): never hand it out from
        here, whether this book holds it already or its apply puts it later (`until`: when to forget it)."""
        with self._lock:
            held = self._ready.get(island_id)
            if held is not None and held.lease_id == lease_id:
                del self._ready[island_id]
            until = as_utc(until)
            self._seen[lease_id] = max(self._seen.get(lease_id, until), until)

    def known(self) -> frozenset[int]:
        """Lease ids of the offers this book held or saw taken, and that have not run out (`put` leaves them out)."""
        with self._lock:
            return frozenset(self._seen)

    def pop(self, island_id: int, *, now: datetime) -> ReadyOffer | None:
        with self._lock:
            offer = self._ready.pop(island_id, None)
        return offer if offer is not None and as_utc(offer.lease.expires_at) >= now else None

    def __len__(self) -> int:
        return len(self._ready)
