"""An httpx transport between an island and the REAL coordinator app that injects faults keyed by
(endpoint, attempt) (STYLE rule 30).

Every request is forwarded to the app (a `fastapi.testclient.TestClient`) unless a fault says otherwise. Faults
are only those the real app cannot produce on demand: 5xx bursts with `Retry-After`, connection errors, a reply
lost after the app acted on the request, corrupt download bytes; and `Before` hooks, which act on the
coordinator at an exact point of the island's protocol (move its clock past a lease's expiry, let another
island in, ask the island to stop). Every exchange is recorded, with whether a fault fired in it, so a test can
assert both that the fault fired and the invariant it threatens.
"""

from __future__ import annotations

import json
import re
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi.testclient import TestClient

ENDPOINTS: tuple[tuple[str, str, str], ...] = (
    ("POST", r"/v1/islands", "join"),
    ("POST", r"/v1/islands/\d+/heartbeat", "heartbeat"),
    ("POST", r"/v1/islands/\d+/lease", "lease"),
    ("DELETE", r"/v1/islands/\d+", "leave"),
    ("GET", r"/v1/modules/\d+/weights", "weights"),
    ("GET", r"/v1/shards/\d+/tokens", "tokens"),
    ("POST", r"/v1/leases/\d+/outer-gradients", "upload"),
    ("POST", r"/v1/leases/\d+/release", "release"),
    ("GET", r"/v1/leases/\d+/modules", "landed"),
)
"""(method, path pattern, endpoint name) of every island-facing endpoint."""


def endpoint_of(request: httpx.Request) -> str:
    for method, pattern, name in ENDPOINTS:
        if request.method == method and re.fullmatch(pattern, request.url.path):
            return name
    return f"{request.method} {request.url.path}"


@dataclass(frozen=True, slots=True)
class Reply:
    """Answer with this status and `{"detail": detail}` instead of forwarding: the app never sees the request."""

    status: int
    headers: dict[str, str] = field(default_factory=dict)
    detail: str = "injected fault"


@dataclass(frozen=True, slots=True)
class Drop:
    """Refuse the connection (`httpx.ConnectError`): the app never sees the request."""


@dataclass(frozen=True, slots=True)
class LoseReply:
    """Forward (the app acts on the request), then answer `status` instead of the app's reply."""

    status: int = 500


@dataclass(frozen=True, slots=True)
class Corrupt:
    """Forward, then flip the last byte of the reply's body (a download then fails its hash check)."""


@dataclass(frozen=True, slots=True)
class Before:
    """Run `action` (on the test's side: move the clock, play another island, stop this one), then forward."""

    action: Callable[[], None]


Fault = Reply | Drop | LoseReply | Corrupt | Before


@dataclass(frozen=True, slots=True)
class Exchange:
    """One request of the island and what became of it."""

    endpoint: str
    attempt: int
    """1-based count of requests to this endpoint, this one included."""
    path: str
    status: int | None
    """The status the island saw; None when the connection was refused."""
    fault: Fault | None
    """The fault that fired on this request, if any."""
    body: bytes
    """The request body (uploads: the safetensors payload as the island sent it)."""
    request_headers: dict[str, str]
    """The request's headers as the island sent them (lower-case names)."""
    reply: Any
    """The reply's JSON, or None (binary reply, no body, refused connection)."""
    headers: dict[str, str]
    """The reply's headers (lower-case names); empty when the connection was refused."""


class FaultyTransport(httpx.BaseTransport):
    """Forwards to `app` (a TestClient over the real coordinator), injecting the faults given to `inject`."""

    def __init__(self, app: TestClient) -> None:
        self._app = app
        self._lock = threading.Lock()
        self._faults: dict[tuple[str, int], Fault] = {}
        self._always: dict[str, Fault] = {}
        self._attempts: defaultdict[str, int] = defaultdict(int)
        self.exchanges: list[Exchange] = []
        self.completed = threading.Condition(self._lock)
        """Notified after every exchange (tests wait on it for the heartbeat thread)."""
        self._open = True
        self._in_flight = 0

    def inject(self, endpoint: str, fault: Fault, *, attempts: Iterable[int] | None = (1,)) -> None:
        """`fault` on these attempts (1-based) at `endpoint`; `attempts=None`: on every attempt."""
        with self._lock:
            if attempts is None:
                self._always[endpoint] = fault
            else:
                self._faults.update({(endpoint, n): fault for n in attempts})

    def inject_next(self, endpoint: str, fault: Fault) -> None:
        """`fault` on the next request to `endpoint` that has not started yet."""
        with self._lock:
            self._faults[(endpoint, self._attempts[endpoint] + 1)] = fault

    def to(self, endpoint: str) -> list[Exchange]:
        """The recorded exchanges with `endpoint`, in order."""
        with self._lock:
            return [e for e in self.exchanges if e.endpoint == endpoint]

    @property
    def fired(self) -> list[Exchange]:
        """The exchanges in which a fault fired."""
        with self._lock:
            return [e for e in self.exchanges if e.fault is not None]

    def wait_for(self, endpoint: str, count: int, *, timeout_s: float = 10.0) -> None:
        """Block until `count` exchanges with `endpoint` have completed."""
        with self.completed:
            if not self.completed.wait_for(lambda: self._count(endpoint) >= count, timeout=timeout_s):
                raise TimeoutError(f"{self._count(endpoint)} of {count} {endpoint} exchanges after {timeout_s}s")

    def count(self, endpoint: str) -> int:
        with self._lock:
            return self._count(endpoint)

    def _count(self, endpoint: str) -> int:
        return sum(e.endpoint == endpoint for e in self.exchanges)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        endpoint = endpoint_of(request)
        body = request.read()
        with self._lock:
            if not self._open:
                raise httpx.ConnectError("the test's coordinator has stopped: connection refused", request=request)
            self._in_flight += 1
        try:
            return self._exchange(request, endpoint, body)
        finally:
            with self.completed:
                self._in_flight -= 1
                self.completed.notify_all()

    def shut(self, *, timeout_s: float = 30.0) -> None:
        """Refuse new requests (as a stopped server does) and wait for those in flight. Before the TestClient
        stops: a request that reaches it while it stops (a thread the test left behind) can hang its portal."""
        with self.completed:
            self._open = False
            if not self.completed.wait_for(lambda: self._in_flight == 0, timeout=timeout_s):
                raise TimeoutError(f"{self._in_flight} requests still in flight after {timeout_s} s")

    def _exchange(self, request: httpx.Request, endpoint: str, body: bytes) -> httpx.Response:
        with self._lock:
            self._attempts[endpoint] += 1
            attempt = self._attempts[endpoint]
            fault = self._faults.pop((endpoint, attempt), None) or self._always.get(endpoint)
        response: httpx.Response | None = None
        try:
            response = self._respond(request, fault)
            return response
        finally:
            self._record(request, endpoint, attempt, fault, body, response)

    def _respond(self, request: httpx.Request, fault: Fault | None) -> httpx.Response:
        if isinstance(fault, Reply):
            return httpx.Response(fault.status, json={"detail": fault.detail}, headers=fault.headers)
        if isinstance(fault, Drop):
            raise httpx.ConnectError("injected fault: connection refused", request=request)
        if isinstance(fault, Before):
            fault.action()
        # Through the whole app (routes, services, DB, blob store). The TestClient is built on its own httpx
        # flavour, so the request is sent again from its parts rather than passed on as an object.
        headers = [(k, v) for k, v in request.headers.multi_items() if k.lower() not in ("host", "content-length")]
        real = self._app.request(request.method, str(request.url), headers=headers, content=request.content)
        if isinstance(fault, LoseReply):
            return httpx.Response(fault.status, json={"detail": "injected fault: reply lost"})
        content = real.content
        if isinstance(fault, Corrupt):
            content = content[:-1] + bytes([content[-1] ^ 0xFF])
        return httpx.Response(real.status_code, headers=list(real.headers.multi_items()), content=content)

    def _record(
        self,
        request: httpx.Request,
        endpoint: str,
        attempt: int,
        fault: Fault | None,
        body: bytes,
        response: httpx.Response | None,
    ) -> None:
        reply = None
        if response is not None and response.headers.get("content-type", "").startswith("application/json"):
            reply = json.loads(response.content)
        exchange = Exchange(
            endpoint=endpoint,
            attempt=attempt,
            path=request.url.path,
            status=None if response is None else response.status_code,
            fault=fault,
            body=body,
            request_headers={k.lower(): v for k, v in request.headers.items()},
            reply=reply,
            headers={} if response is None else dict(response.headers),
        )
        with self.completed:
            self.exchanges.append(exchange)
            self.completed.notify_all()
