"""The wake-up signal behind long-polled lease requests."""

from __future__ import annotations

import asyncio
import threading
import time

from coordinator.work import WorkSignal


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
