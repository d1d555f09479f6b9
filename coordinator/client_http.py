"""The HTTP layer of `coordinator.client.CoordinatorClient`: one bearer token, retries, streamed bodies, and
replies checked into the wire schemas or the `coordinator.client_errors` hierarchy.

Every request retries connection errors, timeouts, 5xx and 429 with capped exponential backoff and full jitter
(honouring `Retry-After`) until `RetryPolicy.give_up_after_s`, then logs and raises `CoordinatorUnavailable`.
A reply with another status than expected raises `RequestRejected` with the server's `detail`; a 2xx whose body
is not the schema raises `BadResponse`; a download that does not hash to what it is addressed by raises
`IntegrityError`. Imports no server dependency.
"""

from __future__ import annotations

import email.utils
import hashlib
import logging
import random
import ssl
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol, Self, TypeVar

import httpx
from pydantic import BaseModel

from coordinator.client_errors import BadResponse, CoordinatorUnavailable, IntegrityError, RequestRejected
from coordinator.schemas import H_CONTENT_HASH

__all__ = [
    "DEFAULT_TIMEOUT",
    "PAGE_LIMIT",
    "UPLOAD_CHUNK",
    "HttpClient",
    "RetryPolicy",
    "Session",
    "detail",
    "parse_retry_after",
    "sha256_hex",
]

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = httpx.Timeout(connect=5.0, read=60.0, write=60.0, pool=5.0)
UPLOAD_CHUNK = 1 << 20
"""Request bodies (outer gradients, shards) are streamed in 1 MiB chunks."""
PAGE_LIMIT = 1000
"""The coordinator's largest `limit` on list endpoints."""
M = TypeVar("M", bound=BaseModel)


class HttpClient(Protocol):
    """What the client needs of its HTTP client: an `httpx.Client`, or anything with the same `request` (tests
    pass Starlette's `TestClient`, which drives the real app in-process)."""

    def request(
        self,
        method: str,
        url: str,
        *,
        content: Any = None,
        json: Any = None,
        params: Any = None,
        headers: Any = None,
    ) -> Any: ...

    def close(self) -> None: ...


@dataclass(kw_only=True, slots=True)
class RetryPolicy:
    """How long and how often a call is retried before the client gives up on the coordinator."""

    give_up_after_s: float = 300.0
    """Total time one call may spend retrying before `CoordinatorUnavailable` is raised."""
    base_s: float = 0.5
    """First backoff ceiling; doubles per attempt (full jitter: the sleep is uniform in [0, ceiling])."""
    cap_s: float = 30.0
    """Largest backoff ceiling."""

    def __post_init__(self) -> None:
        if self.give_up_after_s < 0 or self.base_s < 0 or self.cap_s < self.base_s:
            raise ValueError(f"retry policy: need give_up_after_s >= 0 and 0 <= base_s <= cap_s, got {self}")

    @classmethod
    def once(cls) -> RetryPolicy:
        """One attempt, no retry: for a command a person is waiting for (they can run it again)."""
        return cls(give_up_after_s=0.0)

    def backoff(self, attempt: int, rng: random.Random) -> float:
        """Full-jitter sleep before retry number `attempt` (1-based)."""
        ceiling = min(self.cap_s, self.base_s * (2 ** (attempt - 1)))
        return rng.uniform(0.0, ceiling)


class _Retryable(Exception):
    """Internal: one failed attempt that may be retried."""

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


def parse_retry_after(value: str | None) -> float | None:
    """`Retry-After` as seconds (delta-seconds or an HTTP date); None when absent or unreadable."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def detail(response: httpx.Response) -> str:
    """The server's `{"detail": ...}` message, or the start of the raw body."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:500] or response.reason_phrase
    if isinstance(body, dict) and "detail" in body:
        message = body["detail"]
        return message if isinstance(message, str) else str(message)
    return str(body)[:500]


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _chunks(payload: bytes | memoryview) -> Iterator[memoryview]:
    """The payload as `UPLOAD_CHUNK` slices, without copies (h11 takes any bytes-like object)."""
    view = memoryview(payload)
    for start in range(0, len(view), UPLOAD_CHUNK):
        yield view[start : start + UPLOAD_CHUNK]


def _file_chunks(path: Path) -> Iterator[bytes]:
    """A file as `UPLOAD_CHUNK` reads, opened when the body is sent."""
    with path.open("rb") as fh:
        while chunk := fh.read(UPLOAD_CHUNK):
            yield chunk


def _streamed(source: bytes | memoryview | Path) -> tuple[Callable[[], Iterator[Any]], int]:
    """A body factory (a fresh iterator per attempt, so a retry resends from the start) and the body's length."""
    if isinstance(source, Path):
        return (lambda: _file_chunks(source)), source.stat().st_size
    return (lambda: _chunks(source)), source.nbytes if isinstance(source, memoryview) else len(source)


class Session:
    """One identity (bearer token) on one coordinator, with retries and checked replies; thread-safe."""

    def __init__(
        self,
        base_url: str,
        token: str,
        *,
        http: HttpClient | None = None,
        retry: RetryPolicy | None = None,
        timeout: httpx.Timeout = DEFAULT_TIMEOUT,
        page_size: int = PAGE_LIMIT,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        ca_file: Path | None = None,
        external: HttpClient | None = None,
    ) -> None:
        """`http`: talk through this client (its base URL, transport and timeouts; `close()` leaves it open); by
        default the session makes its own `httpx.Client` on `base_url` with `timeout`, trusting the system's
        certificate authorities, or only `ca_file` (PEM) when given (a coordinator with its own certificate).
        `page_size`: items per request of the list calls (1-1000). `sleep`, `clock`, `rng`: injectable for tests.
        `external`: the client for the blob store's pre-signed URLs (default: a plain `httpx.Client`).
        """
        if not 1 <= page_size <= PAGE_LIMIT:
            raise ValueError(f"page_size must be in 1..{PAGE_LIMIT}, got {page_size}")
        self.base_url = base_url
        self._owns_http = http is None
        self._verify: ssl.SSLContext | bool = True
        if ca_file is not None:
            try:
                self._verify = ssl.create_default_context(cafile=str(ca_file))
            except (OSError, ssl.SSLError) as exc:
                raise ValueError(f"cannot use {ca_file} as a CA file: {exc}") from exc
        self._external: HttpClient | None = external
        self._owns_external = external is None
        if http is None:
            http = httpx.Client(base_url=base_url, timeout=timeout, verify=self._verify)
        self._http: HttpClient = http
        self._token = token
        self._timeout = timeout
        self.page_size = page_size
        self.retry = retry if retry is not None else RetryPolicy()
        self._sleep = sleep
        self._clock = clock
        self._rng = rng if rng is not None else random.Random()
        self.attempts = 0
        """Total HTTP attempts made (all calls)."""
        self.retries = 0
        """Attempts that failed in a retryable way and were retried."""

    def close(self) -> None:
        if self._owns_http:
            self._http.close()
        if self._external is not None and self._owns_external:
            self._external.close()

    def external(self) -> HttpClient:
        """The HTTP client for pre-signed URLs of the blob store (absolute, carrying their own authorisation):
        made on first use, with the session's timeouts and trust (`external=` injects one, for tests)."""
        if self._external is None:
            self._external = httpx.Client(timeout=self._timeout, verify=self._verify)
        return self._external

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def request(
        self,
        method: str,
        url: str,
        *,
        what: str,
        params: Mapping[str, Any] | None = None,
        json: Any = None,
        body: Callable[[], Iterator[Any]] | None = None,
        headers: Mapping[str, str] | None = None,
        timeout: httpx.Timeout | None = None,
        give_up_after_s: float | None = None,
        presigned: bool = False,
    ) -> httpx.Response:
        """Send with retries; return the first response that is neither 5xx nor 429. Query parameters that are
        None are left out. `body` builds a fresh streamed request body per attempt, so an upload can be retried.
        `presigned`: `url` is a pre-signed URL of the blob store, sent without the bearer token (`external`).
        """
        budget = self.retry.give_up_after_s if give_up_after_s is None else give_up_after_s
        query = {k: v for k, v in (params or {}).items() if v is not None} or None
        # only when set: an injected client may be of another httpx flavour with its own "use the default" marker
        extra: dict[str, Any] = {"timeout": timeout} if timeout is not None else {}
        start = self._clock()
        attempt = 0
        while True:
            attempt += 1
            self.attempts += 1
            try:
                auth = {} if presigned else {"Authorization": f"Bearer {self._token}"}
                response: httpx.Response = (self.external() if presigned else self._http).request(
                    method,
                    url,
                    params=query,
                    json=json,
                    content=body() if body is not None else None,
                    headers={**auth, **(headers or {})},
                    **extra,
                )
                if response.status_code == 429 or response.status_code >= 500:
                    raise _Retryable(
                        f"HTTP {response.status_code}: {detail(response)}",
                        parse_retry_after(response.headers.get("Retry-After")),
                    )
                return response
            except (httpx.TransportError, _Retryable) as exc:
                message = f"{type(exc).__name__}: {exc}" if isinstance(exc, httpx.TransportError) else str(exc)
                hint = exc.retry_after_s if isinstance(exc, _Retryable) else None
                elapsed = self._clock() - start
                remaining = budget - elapsed
                if remaining <= 0:
                    # loud when a retrying caller gives up; a caller that asked for one attempt handles the error
                    level = logging.ERROR if budget > 0 else logging.DEBUG
                    log.log(level, "%s: giving up after %d attempt(s) over %.1fs: %s", what, attempt, elapsed, message)
                    raise CoordinatorUnavailable(
                        what=f"{what} ({method} {url})",
                        attempts=attempt,
                        elapsed_s=elapsed,
                        last_error=message,
                        base_url=self.base_url,
                    ) from (exc if isinstance(exc, httpx.TransportError) else None)
                delay = hint if hint is not None else self.retry.backoff(attempt, self._rng)
                delay = min(delay, remaining)
                self.retries += 1
                log.warning("%s: attempt %d failed (%s); retrying in %.2fs", what, attempt, message, delay)
                self._sleep(delay)

    @staticmethod
    def check(response: httpx.Response, *, what: str, ok: tuple[int, ...]) -> httpx.Response:
        """The response, if its status is one of `ok`; else `RequestRejected` with the server's detail."""
        if response.status_code not in ok:
            raise RequestRejected(response.status_code, detail(response), what=what)
        return response

    @staticmethod
    def parse(model: type[M], response: httpx.Response, *, what: str) -> M:
        """The JSON body as `model`; `BadResponse` when it is not one."""
        try:
            return model.model_validate(response.json())
        except ValueError as exc:  # a JSON decode error or a pydantic ValidationError
            raise BadResponse(what=what, problem=str(exc)[:500]) from exc

    def call(
        self,
        method: str,
        url: str,
        model: type[M],
        *,
        what: str,
        ok: tuple[int, ...] = (200,),
        params: Mapping[str, Any] | None = None,
        json: Any = None,
    ) -> M:
        """One request whose reply is `model`."""
        response = self.request(method, url, what=what, params=params, json=json)
        return self.parse(model, self.check(response, what=what, ok=ok), what=what)

    def list_all(self, url: str, model: type[M], *, what: str, params: Mapping[str, Any] | None = None) -> list[M]:
        """Every item of a list endpoint (`{"data": [...], "count": N}`), `page_size` at a time via
        `offset`/`limit`, in the server's order."""
        items: list[M] = []
        while True:
            query = {**(params or {}), "offset": len(items), "limit": self.page_size}
            response = self.check(self.request("GET", url, what=what, params=query), what=what, ok=(200,))
            try:
                body = response.json()
                page = [model.model_validate(item) for item in body["data"]]
                count = int(body["count"])
            except (ValueError, KeyError, TypeError) as exc:
                raise BadResponse(what=what, problem=f"not a page of {model.__name__}: {exc}"[:500]) from exc
            items.extend(page)
            if not page or len(items) >= count:
                return items

    def download(
        self,
        url: str,
        *,
        what: str,
        expected_hash: str | None,
        params: Mapping[str, Any] | None = None,
        presigned: bool = False,
    ) -> bytes:
        """The body of a blob download, checked against `expected_hash` (None: the sha256 the server sends in
        `X-Dipaco-Content-Sha256`). `presigned`: straight from the blob store (see `request`)."""
        response = self.request("GET", url, what=what, params=params, presigned=presigned)
        response = self.check(response, what=what, ok=(200,))
        data = response.content
        expected = expected_hash or response.headers.get(H_CONTENT_HASH)
        if not expected:
            raise BadResponse(what=what, problem=f"no sha256 to check against (no {H_CONTENT_HASH} header)")
        actual = sha256_hex(data)
        if actual != expected:
            raise IntegrityError(what=what, expected=expected, actual=actual)
        return data

    def send(
        self,
        url: str,
        source: bytes | memoryview | Path,
        *,
        what: str,
        headers: Mapping[str, str] | None = None,
        params: Mapping[str, Any] | None = None,
        method: str = "POST",
        presigned: bool = False,
    ) -> httpx.Response:
        """POST (or PUT) a raw body (bytes, or a file read from disk as it is sent) in `UPLOAD_CHUNK`s with an
        explicit length: streamed but not chunk-encoded, so the server can refuse an oversize body before reading
        it. `presigned`: to a pre-signed URL of the blob store (see `request`)."""
        body, length = _streamed(source)
        sent = {**(headers or {}), "Content-Type": "application/octet-stream", "Content-Length": str(length)}
        return self.request(method, url, what=what, headers=sent, params=params, body=body, presigned=presigned)
