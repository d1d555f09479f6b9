"""`Server-Timing: app;dur=<ms>` on every reply: the coordinator's own time on a request, from the moment the
server hands it to the app until the reply starts. Routes that hold requests on purpose (long-polled leases)
set the header themselves, without the hold, and are left alone. What it leaves out is the time a request
waited before the server read it (a busy event loop, the socket backlog): the client sees that part too."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

HEADER = b"server-timing"


class ServerTiming:
    """Pure ASGI middleware (no request objects built, a few microseconds a request)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.monotonic()

        async def timed_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                if not any(name.lower() == HEADER for name, _ in headers):
                    headers.append((HEADER, f"app;dur={(time.monotonic() - started) * 1000:.1f}".encode()))
                    message["headers"] = headers
            await send(message)

        await self.app(scope, receive, timed_send)
