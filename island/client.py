"""`CoordinatorClient`: the island's narrow, retrying view of the coordinator's REST API.

One long-lived `httpx.Client` per island. Every call retries connection errors, timeouts, 5xx and 429 with
capped exponential backoff and full jitter (honouring `Retry-After`) until `RetryPolicy.give_up_after_s`,
then raises `CoordinatorUnavailable`. Other 4xx become `RequestRejected` (409 on an upload: `LeaseLost`).

Timeouts, from short to long (see also the coordinator's settings):
  HTTP connect 5 s / pool 5 s  <  HTTP read/write 60 s  <  heartbeat interval (server-chosen)  <  lease TTL
  <  round deadline; `give_up_after_s` (default 300 s) bounds how long one call keeps retrying.
"""

from __future__ import annotations

import email.utils
import hashlib
import logging
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import httpx

from coordinator.schemas import (
    H_IDLE,
    H_ROUND,
    H_TOKENS,
    H_TRAIN_LOSS,
    ContributionPublic,
    HeartbeatReply,
    IslandCapabilities,
    IslandJoin,
    IslandJoined,
    LeasePublic,
)
from island.errors import CoordinatorUnavailable, IntegrityError, LeaseLost, RequestRejected

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = httpx.Timeout(connect=5.0, read=60.0, write=60.0, pool=5.0)
UPLOAD_CHUNK = 1 << 20
"""Upload bodies are streamed in 1 MiB chunks."""

IdleReason = Literal["waiting", "no-running-runs"]


@dataclass(kw_only=True, slots=True)
class RetryPolicy:
    """How long and how often a call is retried before the island gives up on the coordinator."""

    give_up_after_s: float = 300.0
    """Total time one call may spend retrying before `CoordinatorUnavailable` is raised."""
    base_s: float = 0.5
    """First backoff ceiling; doubles per attempt (full jitter: the sleep is uniform in [0, ceiling])."""
    cap_s: float = 30.0
    """Largest backoff ceiling."""

    def __post_init__(self) -> None:
        if self.give_up_after_s < 0 or self.base_s < 0 or self.cap_s < self.base_s:
            raise ValueError(f"retry policy: need give_up_after_s >= 0 and 0 <= base_s <= cap_s, got {self}")

    def backoff(self, attempt: int, rng: random.Random) -> float:
        """Full-jitter sleep before retry number `attempt` (1-based)."""
        ceiling = min(self.cap_s, self.base_s * (2 ** (attempt - 1)))
        return rng.uniform(0.0, ceiling)


@dataclass(frozen=True, slots=True)
class Idle:
    """Why the last lease request got 204 and how long the coordinator asked us to wait."""

    reason: IdleReason
    retry_after_s: float


class _Retryable(Exception):
    """Internal: one failed attempt that may be retried."""

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


def _parse_retry_after(value: str | None) -> float | None:
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


def _detail(response: httpx.Response) -> str:
    """The server's `{"detail": ...}` message, or the start of the raw body."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:500] or response.reason_phrase
    if isinstance(body, dict) and "detail" in body:
        detail = body["detail"]
        return detail if isinstance(detail, str) else str(detail)
    return str(body)[:500]


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _chunks(payload: bytes) -> Iterator[memoryview]:
    """The payload as `UPLOAD_CHUNK` slices, without copies (h11 takes any bytes-like object); a fresh
    generator per attempt, so retries resend from the start."""
    view = memoryview(payload)
    for start in range(0, len(view), UPLOAD_CHUNK):
        yield view[start : start + UPLOAD_CHUNK]


class CoordinatorClient:
    """Typed, retrying calls to the coordinator; safe to share with the heartbeat thread."""

    def __init__(
        self,
        base_url: str,
        join_token: str,
        *,
        http: httpx.Client | None = None,
        retry: RetryPolicy | None = None,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        self._http = http if http is not None else httpx.Client(base_url=base_url, timeout=DEFAULT_TIMEOUT)
        self._owns_http = http is None
        self._join_token = join_token
        self.retry = retry if retry is not None else RetryPolicy()
        self._sleep = sleep
        self._clock = clock
        self._rng = rng if rng is not None else random.Random()
        self.island_id: int | None = None
        self._island_token: str | None = None
        self.idle: Idle | None = None
        """Set by `lease()` when it returns None."""
        self.attempts = 0
        """Total HTTP attempts made (all calls)."""
        self.retries = 0
        """Attempts that failed in a retryable way and were retried."""

    # -- plumbing ----------------------------------------------------------------------------------------

    def close(self) -> None:
        if self._owns_http:
            self._http.close()

    def _auth(self) -> dict[str, str]:
        token = self._island_token or self._join_token
        return {"Authorization": f"Bearer {token}"}

    def _island_path(self, suffix: str = "") -> str:
        if self.island_id is None:
            raise RuntimeError("the island has not joined yet; call join() first")
        return f"/v1/islands/{self.island_id}{suffix}"

    def _request(
        self,
        method: str,
        url: str,
        *,
        what: str,
        give_up_after_s: float | None = None,
        body: Callable[[], Any] | None = None,
        **kwargs: Any,
    ) -> httpx.Response:
        """Send with retries; return the first response that is neither 5xx nor 429.

        `body` builds a fresh request body (`content=`) per attempt, so a streamed upload can be retried.
        """
        budget = self.retry.give_up_after_s if give_up_after_s is None else give_up_after_s
        extra_headers: dict[str, str] = kwargs.pop("headers", {})
        start = self._clock()
        attempt = 0
        while True:
            attempt += 1
            self.attempts += 1
            try:
                if body is not None:
                    kwargs["content"] = body()
                headers = {**self._auth(), **extra_headers}
                response = self._http.request(method, url, headers=headers, **kwargs)
                if response.status_code == 429 or response.status_code >= 500:
                    raise _Retryable(
                        f"HTTP {response.status_code}: {_detail(response)}",
                        _parse_retry_after(response.headers.get("Retry-After")),
                    )
                return response
            except (httpx.TransportError, _Retryable) as exc:
                message = f"{type(exc).__name__}: {exc}" if isinstance(exc, httpx.TransportError) else str(exc)
                hint = exc.retry_after_s if isinstance(exc, _Retryable) else None
                elapsed = self._clock() - start
                remaining = budget - elapsed
                if remaining <= 0:
                    log.error("%s: giving up after %d attempt(s) over %.1fs: %s", what, attempt, elapsed, message)
                    raise CoordinatorUnavailable(
                        what=f"{what} ({method} {url})",
                        attempts=attempt,
                        elapsed_s=elapsed,
                        last_error=message,
                    ) from (exc if isinstance(exc, httpx.TransportError) else None)
                delay = hint if hint is not None else self.retry.backoff(attempt, self._rng)
                delay = min(delay, remaining)
                self.retries += 1
                log.warning("%s: attempt %d failed (%s); retrying in %.2fs", what, attempt, message, delay)
                self._sleep(delay)

    def _check(self, response: httpx.Response, *, what: str, ok: tuple[int, ...]) -> httpx.Response:
        if response.status_code not in ok:
            raise RequestRejected(response.status_code, _detail(response), what=what)
        return response

    # -- island lifecycle ----------------------------------------------------------------------------------

    def join(self, name: str, site: str, capabilities: IslandCapabilities) -> IslandJoined:
        """Register with the join token; afterwards every call uses the island token."""
        body = IslandJoin(name=name, site=site, capabilities=capabilities)
        what = f"join as {name!r}"
        response = self._request("POST", "/v1/islands", what=what, json=body.model_dump(mode="json"))
        joined = IslandJoined.model_validate(self._check(response, what=what, ok=(200, 201)).json())
        self.island_id = joined.island_id
        self._island_token = joined.token
        return joined

    def heartbeat(self, *, give_up_after_s: float | None = None) -> HeartbeatReply:
        what = f"heartbeat of island {self.island_id}"
        response = self._request("POST", self._island_path("/heartbeat"), what=what, give_up_after_s=give_up_after_s)
        return HeartbeatReply.model_validate(self._check(response, what=what, ok=(200,)).json())

    def lease(self, *, wait_s: float = 0.0) -> LeasePublic | None:
        """Ask for work. None when there is none right now; `self.idle` then says why and how long to wait.

        With `wait_s` the coordinator holds the request up to that long while there is no work (long polling),
        and answers the moment a round opens or a path is given back.
        """
        what = f"lease request of island {self.island_id}"
        kwargs: dict[str, Any] = {}
        if wait_s > 0:  # the read may take the whole wait
            kwargs["params"] = {"wait": wait_s}
            kwargs["timeout"] = httpx.Timeout(
                connect=DEFAULT_TIMEOUT.connect,
                read=(DEFAULT_TIMEOUT.read or 60.0) + wait_s,
                write=DEFAULT_TIMEOUT.write,
                pool=DEFAULT_TIMEOUT.pool,
            )
        response = self._request("POST", self._island_path("/lease"), what=what, **kwargs)
        if response.status_code == 204:
            raw = response.headers.get(H_IDLE, "waiting")
            reason: IdleReason = "no-running-runs" if raw == "no-running-runs" else "waiting"
            wait = _parse_retry_after(response.headers.get("Retry-After"))
            self.idle = Idle(reason=reason, retry_after_s=2.0 if wait is None else wait)
            return None
        self.idle = None
        return LeasePublic.model_validate(self._check(response, what=what, ok=(200,)).json())

    def release(self, lease_id: int, *, give_up_after_s: float | None = None) -> None:
        """Give a lease back. A 409 (already closed / not active) is fine: nothing left to give back."""
        what = f"release of lease {lease_id}"
        response = self._request("POST", f"/v1/leases/{lease_id}/release", what=what, give_up_after_s=give_up_after_s)
        self._check(response, what=what, ok=(200, 204, 409))

    def leave(self, *, give_up_after_s: float | None = None) -> None:
        what = f"leave of island {self.island_id}"
        response = self._request("DELETE", self._island_path(), what=what, give_up_after_s=give_up_after_s)
        self._check(response, what=what, ok=(200, 204))

    # -- blobs -------------------------------------------------------------------------------------------

    def _download(self, url: str, *, what: str, expected_hash: str, params: dict[str, Any] | None = None) -> bytes:
        response = self._check(self._request("GET", url, what=what, params=params), what=what, ok=(200,))
        data = response.content
        actual = sha256_hex(data)
        if actual != expected_hash:
            raise IntegrityError(what=what, expected=expected_hash, actual=actual)
        return data

    def module_weights(self, module_id: int, version: int, expected_hash: str) -> bytes:
        """Safetensors bytes of one module version, verified against `expected_hash`."""
        return self._download(
            f"/v1/modules/{module_id}/weights",
            what=f"weights of module {module_id} v{version}",
            expected_hash=expected_hash,
            params={"version": version},
        )

    def shard_tokens(self, shard_id: int, expected_hash: str) -> bytes:
        """The whole shard token file (little-endian uint16), verified against `expected_hash`."""
        return self._download(
            f"/v1/shards/{shard_id}/tokens", what=f"tokens of shard {shard_id}", expected_hash=expected_hash
        )

    # -- results -----------------------------------------------------------------------------------------

    def upload(self, lease: LeasePublic, payload: bytes, *, tokens: int, train_loss: float) -> ContributionPublic:
        """Stream the outer gradients of a lease. Idempotent on the server, so retries are safe.

        Raises `LeaseLost` on 409 (round closed or lease no longer active).
        """
        what = f"upload for lease {lease.lease_id} (round {lease.round}, path {lease.path_index})"
        headers = {
            H_ROUND: str(lease.round),
            H_TOKENS: str(tokens),
            H_TRAIN_LOSS: repr(float(train_loss)),
            "Content-Type": "application/octet-stream",
            # An explicit length keeps the body streamed but not chunk-encoded, so the server can
            # refuse an oversize upload before reading it.
            "Content-Length": str(len(payload)),
        }
        response = self._request(
            "POST",
            f"/v1/leases/{lease.lease_id}/outer-gradients",
            what=what,
            headers=headers,
            body=lambda: _chunks(payload),
        )
        if response.status_code == 409:
            raise LeaseLost(lease.lease_id, _detail(response))
        return ContributionPublic.model_validate(self._check(response, what=what, ok=(200, 201)).json())
