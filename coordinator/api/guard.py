"""The door of the API: every `/v1/` request is authenticated from its headers before any of its body is read,
and JSON bodies are capped.

FastAPI reads and parses a request's JSON body before it resolves the endpoint's dependencies, so without this
a request with no token or a wrong one could make the coordinator read and parse hundreds of MB (measured: a
400 MiB body with a wrong token cost 2.3 s and ~1 GB of peak memory). Here, a request that does not
authenticate costs a header parse (and, for an island token not seen recently, one indexed lookup): the reply
goes out and the body is never read. The principal found is left in `scope["state"]["principal"]` for the
endpoint (`deps.get_principal`), so a request is authenticated once.

The two raw uploads (outer gradients, shards: `RAW_BODY_PATHS`) are streamed to disk with caps of their own
(`api/spool.py`); every other body is capped at `Settings.max_json_bytes`, whatever its content type: a declared
`Content-Length` over it is refused at once (413), and a body that turns out longer while it streams is cut off
and answered 413.
"""

from __future__ import annotations

import json
import re
from typing import Any

from coordinator.api.deps import AppState, principal_for
from coordinator.errors import PayloadTooLarge, ServiceError
from coordinator.timing import ASGIApp, Message, Receive, Scope, Send

RAW_BODY_PATHS = re.compile(r"/v1/(leases/[^/]+/outer-gradients|runs/[^/]+/shards/[^/]+(/heldout)?)")
"""The routes whose body is a raw upload, spooled with its own cap."""


class RequestGuard:
    """Pure ASGI middleware (see the module docstring)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        state: AppState = scope["app"].state.dipaco
        headers = dict(scope["headers"])
        try:
            principal = await principal_for(state, _header(headers, b"authorization"))
            raw = RAW_BODY_PATHS.fullmatch(scope["path"]) is not None
            limit = None if raw else state.settings.max_json_bytes
            if limit is not None:
                _check_declared_length(headers, limit)
        except ServiceError as exc:
            state.metrics.refused_requests.labels(reason=type(exc).__name__.lower()).inc()
            await _reply(send, exc.status_code, exc.detail)
            return
        scope.setdefault("state", {})["principal"] = principal
        if limit is None:
            await self.app(scope, receive, send)
            return
        await self._capped(scope, receive, send, limit)

    async def _capped(self, scope: Scope, receive: Receive, send: Send, limit: int) -> None:
        """Run the app with a body that may not exceed `limit` bytes; past it, the app's reply becomes 413."""
        received = 0
        over = False
        started = False

        async def capped_receive() -> Message:
            nonlocal received, over
            if over:  # the app asks again after being cut off: tell it the client went away
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    over = True
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if over:
                if message["type"] == "http.response.start" and not started:
                    started = True
                    await _reply(send, 413, f"body is over the {limit}-byte limit for JSON requests")
                return  # whatever the app answers to a body it never got whole
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, capped_receive, guarded_send)
        except Exception:
            if not over:
                raise
        if over and not started:
            await _reply(send, 413, f"body is over the {limit}-byte limit for JSON requests")


def _header(headers: dict[bytes, bytes], name: bytes, default: str | None = None) -> Any:
    value = headers.get(name)
    return default if value is None else value.decode("latin-1")


def _check_declared_length(headers: dict[bytes, bytes], limit: int) -> None:
    declared = _header(headers, b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"body of {int(declared)} bytes is over the {limit}-byte limit for JSON requests")


async def _reply(send: Send, status: int, detail: str) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})
