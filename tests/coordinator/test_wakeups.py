"""The wake-up signal behind long-polled lease requests."""

from __future__ import annotations

import asyncio
import threading
import time
from datetime import UTC, datetime, timedelta

from coordinator.auth import IslandTokenCache
from coordinator.wakeups import WorkSignal


def test_a_notification_from_another_thread_wakes_waiters_and_is_not_lost_between_ticket_and_wait() -> None:
    async def scenario() -> list[float]:
        signal = WorkSignal()
        signal.bind(asyncio.get_running_loop())
        ticket = signal.ticket()
        signal.notify()  # fires before anyone waits: the ticket still sees it
        await asyncio.sleep(0.01)
        started = time.monotonic()
        await signal.wait(ticket, 5)
        already = time.monotonic() - started

        late = signal.ticket()
        threading.Timer(0.2, signal.notify).start()
        started = time.monotonic()
        await signal.wait(late, 5)
        woken = time.monotonic() - started

        started = time.monotonic()
        await signal.wait(signal.ticket(), 0.2)  # nothing happens: the timeout
        timed_out = time.monotonic() - started
        return [already, woken, timed_out]

    already, woken, timed_out = asyncio.run(scenario())
    assert already < 0.1
    assert 0.15 < woken < 2
    assert 0.15 < timed_out < 2


def test_signature_changes_notify_but_the_first_reading_only_records() -> None:
    async def scenario() -> tuple[bool, bool, bool]:
        signal = WorkSignal()
        signal.bind(asyncio.get_running_loop())
        results = []
        for signature in [(1, 0), (1, 0), (2, 0)]:
            ticket = signal.ticket()
            signal.notify_if_changed(signature)
            await asyncio.sleep(0.01)
            assert ticket is not None
            results.append(ticket.is_set())
        return results[0], results[1], results[2]

    assert asyncio.run(scenario()) == (False, False, True)


def test_an_idle_island_skips_the_database_until_a_notification_or_its_deadline() -> None:
    async def scenario() -> list[bool]:
        signal = WorkSignal()
        signal.bind(asyncio.get_running_loop())
        now = datetime(2026, 1, 1, tzinfo=UTC)
        seen = [signal.nothing_new(1, now)]  # never asked: ask the database
        signal.remember_idle(1, signal.ticket(), None)
        seen.append(signal.nothing_new(1, now + timedelta(hours=1)))  # nothing can change by time alone
        signal.notify()
        await asyncio.sleep(0.01)
        seen.append(signal.nothing_new(1, now))  # something changed: ask again
        signal.remember_idle(2, signal.ticket(), now + timedelta(seconds=10))  # e.g. a lease expiring then
        seen += [signal.nothing_new(2, now + timedelta(seconds=9)), signal.nothing_new(2, now + timedelta(seconds=10))]
        return seen

    assert asyncio.run(scenario()) == [False, True, False, True, False]


def test_island_token_cache_expires_forgets_and_can_be_off() -> None:
    now = [100.0]
    cache = IslandTokenCache(30, clock=lambda: now[0])
    cache.put("d1", 1)
    cache.put("d2", 2)
    assert (cache.get("d1"), cache.get("d2"), cache.get("d3")) == (1, 2, None)
    cache.forget(1)  # a leave or revoke served by this process
    assert (cache.get("d1"), cache.get("d2")) == (None, 2)
    now[0] += 30.5
    assert cache.get("d2") is None  # a revoke elsewhere is honoured once the entry runs out
    off = IslandTokenCache(0)
    off.put("d1", 1)
    assert off.get("d1") is None
