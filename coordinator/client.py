"""`CoordinatorClient`: the one typed client of the coordinator's REST API (ARCHITECTURE §2, §5).

Everything that talks to the coordinator goes through it: the island, the commands (`dipaco registry`, `eval`,
`export`, `generate`, `router register|refit`), the quality driver and the benches. It imports no server
dependency (httpx, pydantic, `coordinator.schemas`, `coordinator.states`), returns the wire schemas and raises
the `coordinator.client_errors` hierarchy.

Retries and replies (`coordinator.client_http.Session`, the HTTP layer under the endpoints here): every call
retries connection errors, timeouts, 5xx and 429 with capped, full-jitter backoff (honouring `Retry-After`) until
`RetryPolicy.give_up_after_s`, then logs and raises `CoordinatorUnavailable`. Other 4xx raise `RequestRejected`
with the server's `detail` (409 on an upload: `LeaseLost`); a 2xx whose body is not the schema raises
`BadResponse`; a download that does not hash to what it is addressed by raises `IntegrityError`. Long-lived
processes keep the default budget; commands that a person is waiting for use `RetryPolicy.once()`.

Identity. The client sends one bearer token (admin, join or island). `join()` registers an island with the join
token and from then on the client *is* that island: it sends the island token, and `heartbeat`, `lease` and
`leave` address its own id; when `lease()` finds no work it returns None and leaves the reason in `idle`. Many
clients may share one HTTP client (`http=`), each with its own identity (e.g. simulated islands in a bench).

Timeouts, from short to long (see also the coordinator's settings):
  HTTP connect 5 s / pool 5 s  <  HTTP read/write 60 s  <  heartbeat interval (server-chosen)  <  lease TTL
  <  round deadline. A long-polled lease request may read for 60 s + its `wait`; `give_up_after_s`
  (default 300 s) bounds how long one call keeps retrying.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from coordinator.client_errors import (
    BadResponse,
    ClientError,
    CoordinatorUnavailable,
    IntegrityError,
    LeaseLost,
    RequestRejected,
)
from coordinator.client_http import (
    DEFAULT_TIMEOUT,
    PAGE_LIMIT,
    UPLOAD_CHUNK,
    HttpClient,
    RetryPolicy,
    Session,
    detail,
    parse_retry_after,
    sha256_hex,
)
from coordinator.schemas import (
    H_CONTENT_HASH,
    H_HELDOUT_LOSS,
    H_IDLE,
    H_REBASED_AT,
    H_ROUND,
    H_TOKENS,
    H_TRAIN_LOSS,
    CommitPart,
    ContributionPublic,
    ContributionSummary,
    EventPublic,
    HeartbeatReply,
    IdleReason,
    IslandCapabilities,
    IslandJoin,
    IslandJoined,
    IslandPublic,
    LeaseModules,
    LeasePublic,
    LeaseSummary,
    ListOf,
    ModulePublic,
    PathPublic,
    RoundPublic,
    RunCreate,
    RunHistory,
    RunPublic,
    RunStats,
    ShardPublic,
    UploadCommit,
    UploadTicket,
    UploadTicketRequest,
)
from coordinator.states import EventKind, IslandStatus, LeaseStatus, RunStatus

__all__ = [
    "DEFAULT_TIMEOUT",
    "PAGE_LIMIT",
    "UPLOAD_CHUNK",
    "BadResponse",
    "ClientError",
    "CoordinatorClient",
    "CoordinatorUnavailable",
    "HttpClient",
    "Idle",
    "IdleReason",
    "IntegrityError",
    "LeaseLost",
    "RequestRejected",
    "RetryPolicy",
    "sha256_hex",
]

log = logging.getLogger(__name__)

IDLE_WAIT_S = 2.0
"""How long to wait after a lease request found no work and the reply had no readable `Retry-After`."""


@dataclass(frozen=True, slots=True)
class Idle:
    """Why the last lease request got 204 and how long the coordinator asked us to wait."""

    reason: IdleReason
    retry_after_s: float


class CoordinatorClient(Session):
    """Typed, retrying calls to every endpoint of the coordinator; safe to share between threads.

    Constructed as `CoordinatorClient(base_url, token, http=..., retry=RetryPolicy(...))`; see `Session` for the
    other keyword arguments. An admin token creates runs, registers shards and revokes islands; a join token
    `join()`s and then the client is that island; any valid token reads."""

    island_id: int | None = None
    """Set by `join()`: the island this client speaks for."""
    idle: Idle | None = None
    """Set by `lease()` when it returns None."""

    def _island_path(self, suffix: str = "") -> str:
        if self.island_id is None:
            raise RuntimeError("the island has not joined yet; call join() first")
        return f"/v1/islands/{self.island_id}{suffix}"

    # -- service -----------------------------------------------------------------------------------------

    def health(self, *, give_up_after_s: float | None = None) -> str:
        """`GET /healthz`: "ok" when the coordinator and its database answer."""
        what = "health check"
        response = self.request("GET", "/healthz", what=what, give_up_after_s=give_up_after_s)
        body = self.check(response, what=what, ok=(200,)).json()
        return str(body.get("status", "")) if isinstance(body, dict) else ""

    def metrics(self) -> str:
        """`GET /metrics`: the Prometheus text exposition."""
        return self.check(self.request("GET", "/metrics", what="metrics"), what="metrics", ok=(200,)).text

    # -- runs and shards (admin writes) ------------------------------------------------------------------

    def runs(self, *, status: RunStatus | None = None) -> list[RunPublic]:
        return self.list_all("/v1/runs", RunPublic, what="list of runs", params={"status": status})

    def run(self, run_id: int) -> RunPublic:
        return self.call("GET", f"/v1/runs/{run_id}", RunPublic, what=f"read of run {run_id}")

    def create_run(self, spec: RunCreate | Mapping[str, Any]) -> RunPublic:
        """Create a run (admin). A mapping is validated into `RunCreate` first (pydantic's ValidationError, a
        ValueError, names a bad field before anything is sent); fields left unset take the server's defaults."""
        body = spec if isinstance(spec, RunCreate) else RunCreate.model_validate(spec)
        what = f"creation of run {body.name!r}"
        response = self.request("POST", "/v1/runs", what=what, json=body.model_dump(mode="json", exclude_unset=True))
        return self.parse(RunPublic, self.check(response, what=what, ok=(200, 201)), what=what)

    def rounds(self, run_id: int) -> list[RoundPublic]:
        """Every round of a run so far (not paginated: a run has few)."""
        return self.call("GET", f"/v1/runs/{run_id}/rounds", ListOf[RoundPublic], what=f"rounds of run {run_id}").data

    def register_shard(self, run_id: int, path_index: int, tokens: bytes | Path, *, num_documents: int) -> ShardPublic:
        """Attach a path's shard to a run (admin): raw little-endian uint16 token ids, from memory or a file
        (streamed from disk)."""
        return self._send_tokens(
            f"/v1/runs/{run_id}/shards/{path_index}", tokens, num_documents, f"shard {path_index} of run {run_id}"
        )

    def shard_tokens(self, shard_id: int, expected_hash: str | None = None, *, url: str | None = None) -> bytes:
        """The whole shard token file (little-endian uint16), verified against `expected_hash` (None: the hash
        the coordinator sends with it). `url`: a pre-signed URL from a lease, fetched from the bucket directly (from the
        coordinator when the bucket refuses it with a 4xx, e.g. an expired URL)."""
        return self._tokens(f"/v1/shards/{shard_id}/tokens", f"tokens of shard {shard_id}", expected_hash, url)

    def register_heldout(
        self, run_id: int, path_index: int, tokens: bytes | Path, *, num_documents: int
    ) -> ShardPublic:
        """Attach a path's held-out slice to a run (admin), after its shard: raw little-endian uint16 token ids,
        from memory or a file (streamed from disk)."""
        return self._send_tokens(
            f"/v1/runs/{run_id}/shards/{path_index}/heldout",
            tokens,
            num_documents,
            f"held-out slice {path_index} of run {run_id}",
        )

    def heldout_tokens(self, shard_id: int, expected_hash: str | None = None, *, url: str | None = None) -> bytes:
        """A shard's held-out slice (little-endian uint16), verified like `shard_tokens`."""
        return self._tokens(f"/v1/shards/{shard_id}/heldout", f"held-out slice of shard {shard_id}", expected_hash, url)

    def _send_tokens(self, path: str, tokens: bytes | Path, num_documents: int, what: str) -> ShardPublic:
        response = self.send(path, tokens, what=what, params={"num_documents": num_documents})
        return self.parse(ShardPublic, self.check(response, what=what, ok=(200, 201)), what=what)

    def _tokens(self, path: str, what: str, expected_hash: str | None, url: str | None) -> bytes:
        if url is not None and expected_hash is not None:  # a pre-signed URL from a lease: from the bucket
            direct = self._from_bucket(url, what=what, expected_hash=expected_hash)
            if direct is not None:
                return direct
        return self.download(path, what=what, expected_hash=expected_hash)

    def _from_bucket(self, url: str, *, what: str, expected_hash: str) -> bytes | None:
        """A blob from a lease's pre-signed URL; None when the bucket refused it with a 4xx (an expired URL: 403),
        said in one log line: the caller fetches it from the coordinator instead, which reads the same store."""
        try:
            return self.download(url, what=f"{what} (direct)", expected_hash=expected_hash, presigned=True)
        except RequestRejected as exc:
            if not 400 <= exc.status < 500:
                raise
            log.warning(
                "%s: the bucket refused the pre-signed GET (HTTP %d: %s); fetching it from the coordinator instead",
                what,
                exc.status,
                exc.detail[:200],
            )
            return None

    # -- modules and paths -------------------------------------------------------------------------------

    def modules(self, *, run_id: int | None = None, level: int | None = None) -> list[ModulePublic]:
        params = {"run_id": run_id, "level": level}
        return self.list_all("/v1/modules", ModulePublic, what="list of modules", params=params)

    def module(self, module_id: int) -> ModulePublic:
        return self.call("GET", f"/v1/modules/{module_id}", ModulePublic, what=f"read of module {module_id}")

    def module_weights(
        self, module_id: int, version: int | None = None, expected_hash: str | None = None, *, url: str | None = None
    ) -> bytes:
        """Safetensors bytes of one module version (None: the current one), verified against `expected_hash`
        (None: the hash the coordinator sends with it, e.g. for an old version). `url`: a pre-signed URL from a
        lease, fetched from the bucket directly (from the coordinator when the bucket refuses it)."""
        if url is not None and expected_hash is not None:
            direct = self._from_bucket(
                url, what=f"weights of module {module_id} v{version}", expected_hash=expected_hash
            )
            if direct is not None:
                return direct
        return self.download(
            f"/v1/modules/{module_id}/weights",
            what=f"weights of module {module_id}" + (f" v{version}" if version is not None else ""),
            expected_hash=expected_hash,
            params={"version": version},
        )

    def paths(self, *, run_id: int | None = None) -> list[PathPublic]:
        return self.list_all("/v1/paths", PathPublic, what="list of paths", params={"run_id": run_id})

    def path(self, path_id: int) -> PathPublic:
        return self.call("GET", f"/v1/paths/{path_id}", PathPublic, what=f"read of path {path_id}")

    def contributions(self, *, run_id: int | None = None, round: int | None = None) -> list[ContributionSummary]:
        params = {"run_id": run_id, "round": round}
        return self.list_all("/v1/contributions", ContributionSummary, what="list of contributions", params=params)

    # -- islands -----------------------------------------------------------------------------------------

    def islands(self, *, status: IslandStatus | None = None) -> list[IslandPublic]:
        return self.list_all("/v1/islands", IslandPublic, what="list of islands", params={"status": status})

    def revoke_island(self, island_id: int) -> None:
        """Remove an island (admin): its token stops working and its leases go back to the pool."""
        what = f"revocation of island {island_id}"
        self.check(self.request("DELETE", f"/v1/islands/{island_id}", what=what), what=what, ok=(200, 204))

    def join(self, name: str, site: str = "local", capabilities: IslandCapabilities | None = None) -> IslandJoined:
        """Register an island with the join token; afterwards this client is that island (island token)."""
        body = IslandJoin(name=name, site=site, capabilities=capabilities or IslandCapabilities())
        what = f"join as {name!r}"
        response = self.request("POST", "/v1/islands", what=what, json=body.model_dump(mode="json"))
        joined = self.parse(IslandJoined, self.check(response, what=what, ok=(200, 201)), what=what)
        self.island_id = joined.island_id
        self._token = joined.token
        return joined

    def heartbeat(self, *, give_up_after_s: float | None = None) -> HeartbeatReply:
        what = f"heartbeat of island {self.island_id}"
        response = self.request("POST", self._island_path("/heartbeat"), what=what, give_up_after_s=give_up_after_s)
        return self.parse(HeartbeatReply, self.check(response, what=what, ok=(200,)), what=what)

    def leave(self, *, give_up_after_s: float | None = None) -> None:
        what = f"leave of island {self.island_id}"
        response = self.request("DELETE", self._island_path(), what=what, give_up_after_s=give_up_after_s)
        self.check(response, what=what, ok=(200, 204))

    def lease(self, *, wait_s: float = 0.0) -> LeasePublic | None:
        """Ask for work. None when there is none right now; `self.idle` then says why and how long to wait.

        With `wait_s` the coordinator holds the request up to that long while there is no work (long polling),
        and answers the moment a round opens or a path is given back."""
        what = f"lease request of island {self.island_id}"
        params, timeout = self._long_poll(wait_s)
        response = self.request("POST", self._island_path("/lease"), what=what, params=params, timeout=timeout)
        if response.status_code == 204:
            raw = response.headers.get(H_IDLE, "waiting")
            reason: IdleReason = "no-running-runs" if raw == "no-running-runs" else "waiting"
            wait = parse_retry_after(response.headers.get("Retry-After"))
            self.idle = Idle(reason=reason, retry_after_s=IDLE_WAIT_S if wait is None else wait)
            return None
        self.idle = None
        return self.parse(LeasePublic, self.check(response, what=what, ok=(200,)), what=what)

    def _long_poll(self, wait_s: float) -> tuple[dict[str, Any], httpx.Timeout | None]:
        """Query and read timeout of a request the coordinator may hold `wait_s` seconds (`?wait=`): the read may
        take the whole wait."""
        if wait_s <= 0:
            return {}, None
        t = self._timeout
        read = (t.read or 60.0) + wait_s
        return {"wait": wait_s}, httpx.Timeout(connect=t.connect, read=read, write=t.write, pool=t.pool)

    # -- leases ------------------------------------------------------------------------------------------

    def lease_modules(self, lease_id: int, *, wait_s: float = 0.0) -> LeaseModules:
        """The modules of one of this island's pending leases at its base versions; `ready` once each has its
        weights (an overlap lease's pending versions landed). With `wait_s` the coordinator holds the request
        until they have, or the time is up. Raises `LeaseLost` on 409 (the lease is no longer pending)."""
        what = f"modules of lease {lease_id}"
        params, timeout = self._long_poll(wait_s)
        response = self.request("GET", f"/v1/leases/{lease_id}/modules", what=what, params=params, timeout=timeout)
        if response.status_code == 409:
            raise LeaseLost(lease_id, detail(response))
        return self.parse(LeaseModules, self.check(response, what=what, ok=(200,)), what=what)

    def release(self, lease_id: int, *, give_up_after_s: float | None = None) -> None:
        """Give a lease back. A 409 (already closed / not active) is fine: nothing left to give back."""
        what = f"release of lease {lease_id}"
        response = self.request("POST", f"/v1/leases/{lease_id}/release", what=what, give_up_after_s=give_up_after_s)
        self.check(response, what=what, ok=(200, 204, 409))

    def upload(
        self,
        lease: LeasePublic,
        payload: bytes,
        *,
        tokens: int,
        train_loss: float,
        heldout_loss: float | None = None,
        rebased_at: int | None = None,
        next_lease: bool = False,
        overlap: bool = False,
    ) -> ContributionPublic:
        """Stream the outer gradients of a lease (with the start weights' held-out loss, when scored). Idempotent on
        the server, so retries are safe. The body's sha256 goes with it (`X-Dipaco-Content-Sha256`), so the
        coordinator need not hash it while receiving; its apply executor checks it. With `next_lease` the reply
        may carry the island's next lease (`ContributionPublic.next_lease`); with `overlap` too (a run with
        `overlap`), that lease may train through module steps due on the uploaded path (its pending modules come
        without weights: see `lease_modules`). `rebased_at`: an overlap lease that started from the island's own
        end weights moved onto its pending versions before that inner step (`X-Dipaco-Rebased-At`).

        Raises `LeaseLost` on 409 (round closed or lease no longer active)."""
        what = f"upload for lease {lease.lease_id} (round {lease.round}, path {lease.path_index})"
        headers = {
            H_ROUND: str(lease.round),
            H_TOKENS: str(tokens),
            H_TRAIN_LOSS: repr(float(train_loss)),
            H_CONTENT_HASH: sha256_hex(payload),
        }
        if heldout_loss is not None:
            headers[H_HELDOUT_LOSS] = repr(float(heldout_loss))
        if rebased_at is not None:
            headers[H_REBASED_AT] = str(rebased_at)
        url = f"/v1/leases/{lease.lease_id}/outer-gradients"
        response = self.send(url, payload, what=what, headers=headers, params=_next_lease(next_lease, overlap))
        if response.status_code == 409:
            raise LeaseLost(lease.lease_id, detail(response))
        return self.parse(ContributionPublic, self.check(response, what=what, ok=(200, 201)), what=what)

    def upload_direct(
        self,
        lease: LeasePublic,
        payload: bytes,
        *,
        tokens: int,
        train_loss: float,
        heldout_loss: float | None = None,
        rebased_at: int | None = None,
        next_lease: bool = False,
        overlap: bool = False,
    ) -> ContributionPublic:
        """Direct transfers (`lease.direct_upload`): ask for a ticket, PUT the outer gradients to the bucket (in
        the ticket's parts when it is a multipart upload, collecting each part's ETag), commit them. Each request
        retries (a part that fails with a 5xx or a lost connection is PUT again); a PUT the bucket refuses with
        403 (e.g. the URL expired while the body was on its way) gets a new ticket once; a commit is idempotent
        on the server. `rebased_at`, `next_lease` and `overlap` as in `upload`.

        Raises `LeaseLost` on 409 (round closed or lease no longer active)."""
        what = f"direct upload for lease {lease.lease_id} (round {lease.round}, path {lease.path_index})"
        digest = sha256_hex(payload)
        ticket_request = UploadTicketRequest(size=len(payload), sha256=digest)
        for attempt in (1, 2):
            response = self.request(
                "POST", f"/v1/leases/{lease.lease_id}/upload-url", what=what, json=ticket_request.model_dump()
            )
            if response.status_code == 409:
                raise LeaseLost(lease.lease_id, detail(response))
            ticket = self.parse(UploadTicket, self.check(response, what=what, ok=(200,)), what=what)
            refused, parts = self._put_body(ticket, payload, what=what, last_try=attempt == 2)
            if refused is None:
                break
            log.warning("%s: the bucket refused the PUT (%s); asking for a new URL", what, detail(refused)[:200])
        commit = UploadCommit(
            key=ticket.key,
            size=len(payload),
            sha256=digest,
            round=lease.round,
            tokens=tokens,
            train_loss=float(train_loss),
            heldout_loss=None if heldout_loss is None else float(heldout_loss),
            rebased_at=rebased_at,
            upload_id=ticket.upload_id,
            parts=parts,
        )
        response = self.request(
            "POST",
            f"/v1/leases/{lease.lease_id}/commit",
            what=f"{what}: commit",
            json=commit.model_dump(),
            params=_next_lease(next_lease, overlap),
        )
        if response.status_code == 409:
            raise LeaseLost(lease.lease_id, detail(response))
        return self.parse(ContributionPublic, self.check(response, what=what, ok=(200,)), what=what)

    def _put_body(
        self, ticket: UploadTicket, payload: bytes, *, what: str, last_try: bool
    ) -> tuple[httpx.Response | None, list[CommitPart] | None]:
        """PUT the body as the ticket says: whole, or part by part. Returns (the bucket's 403, when it refused and
        this is not the last try; the parts with their ETags, for a multipart upload)."""
        if ticket.url is not None:
            put = self.send(ticket.url, payload, what=f"{what}: PUT", method="PUT", presigned=True)
            if put.status_code == 403 and not last_try:
                return put, None
            self.check(put, what=f"{what}: PUT", ok=(200, 201, 204))
            return None, None
        if ticket.upload_id is None or not ticket.parts:
            raise BadResponse(what=what, problem="the upload ticket has neither a URL nor parts")
        view = memoryview(payload)
        parts: list[CommitPart] = []
        for part in ticket.parts:
            part_what = f"{what}: part {part.number} of {len(ticket.parts)}"
            put = self.send(
                part.url, view[part.offset : part.offset + part.size], what=part_what, method="PUT", presigned=True
            )
            if put.status_code == 403 and not last_try:
                return put, None
            etag = self.check(put, what=part_what, ok=(200, 201, 204)).headers.get("ETag")
            if not etag:
                raise BadResponse(what=part_what, problem="the bucket's answer has no ETag")
            parts.append(CommitPart(number=part.number, etag=etag))
        return None, parts

    # -- watching a run (what the dashboard at /ui/ reads) -----------------------------------------------

    def history(self, run_id: int, *, from_round: int = 0) -> RunHistory:
        """The run's rounds from `from_round` on, each with every contributing path's train loss (all pages)."""
        what = f"history of run {run_id}"
        url = f"/v1/runs/{run_id}/history"
        page = self.call("GET", url, RunHistory, what=what, params={"offset": from_round, "limit": self.page_size})
        rounds = list(page.data)
        while page.data and from_round + len(rounds) < page.count:
            params = {"offset": from_round + len(rounds), "limit": self.page_size}
            page = self.call("GET", url, RunHistory, what=what, params=params)
            rounds.extend(page.data)
        return page.model_copy(update={"data": rounds})

    def run_stats(self, *, status: RunStatus | None = None) -> list[RunStats]:
        """Totals per run (rounds applied, tokens, islands at work, latest loss, time per round)."""
        return self.list_all("/v1/run-stats", RunStats, what="run statistics", params={"status": status})

    def leases(
        self,
        *,
        run_id: int | None = None,
        island_id: int | None = None,
        status: LeaseStatus | None = None,
        round: int | None = None,
    ) -> list[LeaseSummary]:
        """Leases, newest first (e.g. `status=LeaseStatus.ACTIVE`: who trains what now)."""
        params = {"run_id": run_id, "island_id": island_id, "status": status, "round": round}
        return self.list_all("/v1/leases", LeaseSummary, what="list of leases", params=params)

    def events(self, *, run_id: int | None = None, kind: EventKind | None = None, after: int = 0) -> list[EventPublic]:
        """Lease expiries, refused uploads and revocations with an id above `after`, oldest first."""
        params = {"run_id": run_id, "kind": kind, "after": after, "order": "asc"}
        return self.list_all("/v1/events", EventPublic, what="list of events", params=params)


def _next_lease(next_lease: bool, overlap: bool) -> dict[str, str] | None:
    """The query of an upload or commit that asks for the next lease with the reply (and may take one that trains
    through module steps due on the uploaded path)."""
    if not next_lease:
        return None
    return {"next_lease": "true", "overlap": "true"} if overlap else {"next_lease": "true"}
