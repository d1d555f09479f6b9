"""Wire schemas shared by the coordinator and the island client. Imports only pydantic.

Tensors never travel as JSON: module weights, shard tokens and outer gradients are raw bodies
(safetensors or little-endian uint16 token files) addressed by sha256 content hash.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

from coordinator.states import ContributionStatus, EventKind, IslandStatus, LeaseStatus, RoundStatus, RunStatus

T = TypeVar("T")

DB_INT_MAX = 2**63 - 1
"""The largest integer every supported database stores (PostgreSQL BIGINT, SQLite INTEGER): ids, counts,
offsets and token numbers from requests are bounded by it (422 above), never an overflow inside the database."""
SEED_MAX = 2**32 - 1
"""Run seeds are 32-bit: leases derive per-path seeds from them that torch must accept."""
STRICT = ConfigDict(extra="forbid", allow_inf_nan=False)
"""Request bodies: unknown fields and NaN/Infinity (or numbers that overflow to them, like 1e309) are refused."""

# Header names used on raw-body requests and responses.
H_ROUND = "X-Dipaco-Round"
"""Upload: the round the island trained for (must equal the lease's round)."""
H_TOKENS = "X-Dipaco-Tokens"
"""Upload: number of tokens the island trained on for this lease."""
H_TRAIN_LOSS = "X-Dipaco-Train-Loss"
"""Upload: mean inner training loss of the lease (float)."""
H_HELDOUT_LOSS = "X-Dipaco-Heldout-Loss"
"""Upload (optional): mean loss of the lease's start weights on its path's held-out slice (`LeasePublic.heldout`)."""
H_REBASED_AT = "X-Dipaco-Rebased-At"
"""Upload (optional, overlap leases): the inner steps trained from the island's own end weights of the path before
the model moved onto the lease's pending module versions (0..H); sent only when it started from them."""
H_CONTENT_HASH = "X-Dipaco-Content-Sha256"
"""Download: sha256 of the body (also sent as the ETag). Upload (optional): the sha256 of the body sent, which the
coordinator then checks in its apply executor instead of while receiving."""
H_IDLE = "X-Dipaco-Idle"
"""Lease 204: `waiting` (work may come; honour Retry-After) or `no-running-runs`."""
H_HELD = "X-Dipaco-Held-Ms"
"""How long a long-polled lease request was held with no work (milliseconds)."""
IdleReason = Literal["waiting", "no-running-runs"]
"""Values of `H_IDLE`."""
Codec = Literal["fp32", "bf16", "int8"]
"""Outer-gradient codecs (`modules.codec.GRAD_CODECS`)."""

# Outer gradient upload: one safetensors file whose tensor names are f"{level_name}/{param_name}",
# one entry for every parameter of every module on the leased path, dtype F32, same shapes as the module.
GRAD_KEY_SEP = "/"


class ListOf(BaseModel, Generic[T]):
    data: list[T]
    count: int


class ModelSpec(BaseModel):
    """Fields of `modules.ModelConfig`; unset fields take the flavour's value."""

    model_config = STRICT
    flavour: str = Field(default="debug", max_length=64)
    vocab_size: int | None = Field(default=None, ge=2, le=65535)
    seq_len: int | None = Field(default=None, ge=2, le=8192)
    d_model: int | None = Field(default=None, ge=8, le=65536)
    n_layers: int | None = Field(default=None, ge=1, le=1024)
    n_heads: int | None = Field(default=None, ge=1, le=1024)
    mlp_ratio: int | None = Field(default=None, ge=1, le=64)
    block: Literal["gpt2", "llama"] | None = Field(
        default=None,
        description="Transformer block: gpt2 (LayerNorm, learned positions, GELU) or llama (RMSNorm, "
        "rotary positions, SwiGLU, no biases); unset: the flavour's",
    )
    tie_embeddings: bool | None = Field(
        default=None, description="LM head = token embedding matrix (kept in the embed level); unset: the flavour's"
    )


class InnerSpec(BaseModel):
    """Inner AdamW settings (see `modules.InnerConfig`); total_steps is set to rounds * inner_steps."""

    model_config = STRICT
    lr: float = Field(default=3e-3, gt=0, le=10)
    min_lr_ratio: float = Field(default=0.1, ge=0, le=1)
    warmup_steps: int = Field(default=10, ge=0, le=10**9)
    weight_decay: float = Field(default=0.1, ge=0, le=10)
    beta1: float = Field(default=0.9, ge=0, lt=1)
    beta2: float = Field(default=0.95, ge=0, lt=1)
    grad_clip: float = Field(default=1.0, ge=0, le=1e6)
    batch_size: int = Field(default=8, ge=1, le=4096)


class OuterSpec(BaseModel):
    """Outer optimizer of every module (see `modules.OuterConfig`, the one home of the outer round)."""

    model_config = STRICT
    lr: float = Field(default=0.7, gt=0, le=10, description="Outer learning rate (DiLoCo: 0.7)")
    async_lr: float | None = Field(
        default=None,
        gt=0,
        le=10,
        description="Outer learning rate of the modules on async levels; null: half of `lr` (measured better per "
        "token than round-sync with about every other contribution one step stale; the run stores the value)",
    )
    momentum: float = Field(default=0.9, ge=0, lt=1, description="Nesterov momentum (DiLoCo: 0.9)")
    async_momentum: float | None = Field(
        default=None,
        ge=0,
        lt=1,
        description="Nesterov momentum of the modules on async levels; null: 0.6 (measured better per token than "
        "0.7, 0.8 and 0.9 with about every other contribution one step stale; the run stores the value)",
    )
    method: Literal["nesterov", "average"] = Field(
        default="nesterov",
        description="`average`: a module becomes the weighted mean of its paths' trained weights (lr, momentum unused)",
    )
    weighting: Literal["uniform", "tokens"] = Field(
        default="uniform",
        description="Weight of a path's outer gradient in its module's mean: equal, or its tokens trained (α, §2.7)",
    )
    sqrt_rescale: bool = Field(
        default=False, description="Multiply a module's mean outer gradient by sqrt(number of contributing paths)"
    )
    max_norm: float | None = Field(
        default=1e4,
        gt=0,
        le=1e30,
        description="Largest L2 norm of one path's outer gradient for one module; larger ones are outliers "
        "(null: no absolute bound)",
    )
    max_norm_ratio: float | None = Field(
        default=10.0,
        gt=1,
        le=1e6,
        description="Outliers also: over this many times the median norm of the round's contributions to the "
        "module (with at least 3 of them; null: no relative bound)",
    )
    outliers: Literal["clip", "refuse"] = Field(
        default="clip",
        description="An outlier is scaled down to the bound (clip) or left out of the round (refuse; with the "
        "absolute bound, the upload itself is refused with 422)",
    )


class RunCreate(BaseModel):
    model_config = STRICT
    name: str = Field(min_length=1, max_length=200)
    model: ModelSpec = ModelSpec()
    layout: str = Field(
        default="embed:shared, b0-0:routed2, b1-1:routed2, head:shared",
        description="Level layout, see modules.layout",
    )
    inner: InnerSpec = InnerSpec()
    outer: OuterSpec = OuterSpec()
    codec: Codec = Field(
        default="int8",
        description="How islands encode their outer gradients: int8 (1 byte a value, one fp32 scale per 256 values, "
        "error feedback on the island; held-out perplexity within 1 % of fp32, docs/LOG.md), bf16 (2) or fp32 (4)",
    )
    sparse_rows: bool = Field(
        default=False,
        description="Islands send only the embedding rows of the tokens their lease saw, and each row is averaged "
        "over the contributions that sent it; rows nobody sent keep their weights and outer momentum. For large "
        "(BPE) vocabularies and routed paths that see few of its tokens; refused with tie_embeddings",
    )
    inner_steps: int = Field(default=20, ge=1, le=1_000_000, description="H: inner steps per round")
    num_rounds: int = Field(default=3, ge=1, le=1_000_000)
    seed: int = Field(default=0, ge=0, le=SEED_MAX)
    lease_ttl_s: float = Field(default=120.0, gt=0, le=86_400, description="Lease expiry without heartbeats")
    max_lease_s: float = Field(
        default=21_600,
        gt=0,
        le=7 * 86_400,
        description="Longest a lease lives, heartbeats or not: its path goes back to the pool after it",
    )
    quorum: float = Field(
        default=1.0, gt=0, le=1, description="Fraction of paths that must contribute to close a round past its deadline"
    )
    round_deadline_s: float | None = Field(
        default=None,
        gt=0,
        le=30 * 86_400,
        description="Seconds after a round opens after which quorum suffices; None: wait for all",
    )

    sync: Literal["round", "async"] = Field(
        default="round",
        description="How modules are updated, unless the layout says otherwise per level (e.g. 'embed:shared:async'): "
        "round (when every path has contributed to a round, or a quorum after its deadline) or async (every "
        "`dn_period` contributions, whoever sends them; a path whose levels are all async never waits for another)",
    )
    max_staleness: int = Field(
        default=4,
        ge=0,
        le=1_000_000,
        description="Async levels: a contribution trained from a module more than this many steps old is refused (409)",
    )
    staleness_damping: Literal["inverse", "inverse_square", "none"] = Field(
        default="inverse",
        description="Async levels: factor of a contribution of staleness s in its module's step: 1/(1+s) "
        "(inverse), 1/(1+s)^2 (inverse_square), or 1 (none)",
    )
    dn_period: int | None = Field(
        default=None,
        ge=1,
        le=1_000_000,
        description="Async levels: contributions per outer (Delayed Nesterov) step of a module; null: the number of "
        "paths that use the module",
    )
    min_inner_steps: int | None = Field(
        default=None,
        ge=1,
        le=1_000_000,
        description="All-async runs: dynamic local updates, each lease's H scaled by its island's speed between "
        "these bounds (null: H = inner_steps)",
    )
    max_inner_steps: int | None = Field(default=None, ge=1, le=1_000_000, description="See min_inner_steps")
    path_leases: int | None = Field(
        default=None,
        ge=1,
        le=64,
        description="All-async runs: leases that may train one path at once, on disjoint token ranges from the "
        "path's current modules (path sharing: an island whose home path is ahead by more than one of its leases "
        "helps the path that trained least); 1: one island per path; null: 2 when every level is async, else 1",
    )
    overlap: bool | None = Field(
        default=None,
        description="All-async runs: while module steps are due on a path, the island that just uploaded it may take "
        "its next lease on it at once, against the versions those steps will make: it trains on from its own end "
        "weights and moves onto the new versions when they land (no wait for the steps); null: on in all-async runs",
    )
    heldout_tokens: int = Field(
        default=4096,
        ge=0,
        le=1 << 22,
        description="The run keeps a held-out slice per path (`POST /v1/runs/{id}/shards/{path}/heldout`, `dipaco "
        "router register`), and each lease's island scores its start weights on up to this many of its tokens and "
        "reports the loss with the upload (held-out perplexity per path per round); 0: the run keeps none",
    )

    @model_validator(mode="after")
    def _lease_lifetime(self) -> RunCreate:
        if self.max_lease_s < self.lease_ttl_s:
            raise ValueError(f"max_lease_s ({self.max_lease_s}) must be at least lease_ttl_s ({self.lease_ttl_s})")
        low, high = self.min_inner_steps, self.max_inner_steps
        if (low is None) != (high is None):
            raise ValueError("min_inner_steps and max_inner_steps go together: set both or neither")
        if low is not None and high is not None and not low <= self.inner_steps <= high:
            raise ValueError(
                f"inner_steps ({self.inner_steps}) must lie within min_inner_steps..max_inner_steps ({low}..{high})"
            )
        return self


class RunPublic(BaseModel):
    id: int
    name: str
    status: RunStatus
    current_round: int
    num_rounds: int
    num_paths: int
    inner_steps: int
    layout: str
    config: dict[str, Any]
    lease_ttl_s: float
    max_lease_s: float
    quorum: float
    round_deadline_s: float | None
    created_at: datetime
    schedule: Literal["round", "async", "hybrid"] = Field(
        default="round",
        description="round: every level per round; async: every level async (no rounds: paths lease on their own, "
        "`current_round` unused); hybrid: async levels step on arrival, round levels at round close",
    )


class LevelPublic(BaseModel):
    index: int
    name: str
    sharing: str
    num_modules: int


class ModulePublic(BaseModel):
    id: int
    run_id: int
    level: int
    level_name: str
    index: int
    sharing: str
    mode: Literal["round", "async"] = Field(default="round", description="How the module is updated")
    version: int
    weights_hash: str
    num_params: int
    updated_at: datetime
    weight_norm: float | None = Field(
        default=None,
        description="L2 norm of the current weights, all tensors together (fp32), measured when the version was "
        "written; null: not measured (modules of runs created before it was recorded)",
    )


class PathPublic(BaseModel):
    id: int
    run_id: int
    index: int
    module_ids: list[int] = Field(description="One module id per level, in level order")
    module_indices: list[int] = Field(description="Module index on each level, in level order")
    shard_id: int | None
    epoch: int
    token_offset: int
    tokens_trained: int
    last_train_loss: float | None


class ShardPublic(BaseModel):
    id: int
    run_id: int
    path_index: int
    tokens_hash: str
    num_tokens: int
    num_documents: int
    heldout_hash: str | None = Field(default=None, description="The path's held-out slice, when registered")
    heldout_tokens: int | None = None
    heldout_documents: int | None = None


class RoundPublic(BaseModel):
    run_id: int
    number: int
    status: RoundStatus
    contributions: int
    mean_train_loss: float | None
    opened_at: datetime
    deadline: datetime | None
    applied_at: datetime | None


class IslandCapabilities(BaseModel):
    model_config = STRICT
    device: str = Field(default="cpu", max_length=64)
    memory_bytes: int | None = Field(default=None, ge=0, le=DB_INT_MAX)
    tokens_per_s: float | None = Field(default=None, ge=0, le=1e15)
    max_leases: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Leases the island can train at once (independent device groups); the coordinator grants at "
        "most DIPACO_MAX_LEASES_PER_ISLAND",
    )


class IslandJoin(BaseModel):
    model_config = STRICT
    name: str = Field(min_length=1, max_length=200)
    site: str = Field(default="local", max_length=200)
    capabilities: IslandCapabilities = IslandCapabilities()


class IslandJoined(BaseModel):
    island_id: int
    token: str = Field(description="Island bearer token; shown once, stored hashed")
    heartbeat_interval_s: float


class IslandStats(BaseModel):
    """What an island has contributed, over every run, measured by the coordinator."""

    contributions: int = Field(description="Contributions recorded for the island's leases")
    tokens_trained: int = Field(description="Tokens of those contributions")
    upload_bytes: int = Field(description="Bytes of their outer-gradient uploads")
    tokens_per_s: float | None = Field(
        description="Measured over its last 10 contributions: their tokens / the time from each lease's issue to "
        "its upload (fetch, train, upload); null with no contribution"
    )


class IslandPublic(BaseModel):
    id: int
    name: str
    site: str
    status: IslandStatus
    capabilities: IslandCapabilities
    last_heartbeat: datetime | None
    created_at: datetime
    stats: IslandStats | None = Field(
        default=None, description="Contributions, tokens and upload bytes, and its measured tokens/s"
    )


class HeartbeatReply(BaseModel):
    island_id: int
    active_lease_ids: list[int]
    heartbeat_interval_s: float


class LeaseModule(BaseModel):
    level: int
    level_name: str
    module_id: int
    version: int
    weights_hash: str | None = Field(
        description="null: the version is not stepped yet (an overlap lease, run field `overlap`): train on from your "
        "own end weights of the path and fetch this version from `GET /v1/leases/{id}/modules` when it lands"
    )
    url: str | None = Field(default=None, description="Pre-signed GET of the weights in the bucket (direct transfers)")


class LeaseShard(BaseModel):
    shard_id: int
    tokens_hash: str
    num_tokens: int
    url: str | None = Field(default=None, description="Pre-signed GET of the token file (direct transfers)")


class LeaseHeldout(BaseModel):
    """The path's held-out slice: score the lease's start weights on its first `score_tokens` tokens."""

    shard_id: int
    tokens_hash: str
    num_tokens: int
    score_tokens: int = Field(description="The run's heldout_tokens")
    url: str | None = Field(default=None, description="Pre-signed GET of the token file (direct transfers)")


class LeasePublic(BaseModel):
    """Work for one island: train `inner_steps` AdamW steps of one path on one token range."""

    lease_id: int
    run_id: int
    round: int
    path_id: int
    path_index: int
    model: dict[str, Any] = Field(description="modules.ModelConfig fields")
    inner: dict[str, Any] = Field(description="modules.InnerConfig fields")
    inner_steps: int
    first_step: int = Field(description="Global inner step of this lease's first step (round * H)")
    modules: list[LeaseModule]
    shard: LeaseShard
    heldout: LeaseHeldout | None = Field(
        default=None, description="The path's held-out slice, when the run keeps one: report the start weights' loss"
    )
    token_start: int = Field(description="First token (inclusive) of the range in the shard")
    token_end: int = Field(description="Last token (exclusive); end - start = H * batch * seq_len + 1")
    epoch: int
    seed: int
    codec: Codec = Field(default="fp32", description="Encode the outer gradient with this codec (the run's)")
    sparse_rows: bool = Field(
        default=False,
        description="Send the embed level's tok_emb.weight as the rows of the tokens in the lease's inputs "
        "(`<name>` (k, d) and `<name>::rows` I64 (k,)), the run's sparse_rows",
    )
    direct_upload: bool = Field(
        default=False,
        description="PUT the outer gradient to the bucket (POST .../upload-url, then .../commit) instead of "
        "uploading it to the coordinator",
    )
    expires_at: datetime
    status: LeaseStatus


class ContributionPublic(BaseModel):
    id: int
    lease_id: int
    run_id: int
    round: int
    path_index: int
    tokens: int
    train_loss: float
    heldout_loss: float | None = Field(default=None, description="The start weights' loss on the held-out slice")
    status: ContributionStatus
    round_applied: bool = Field(
        description="Whether the round this upload went into has closed with it (this upload completed it, or a sweep "
        "or a concurrent upload closed it right after); its outer step follows on the apply executors"
    )
    next_lease: LeasePublic | None = Field(
        default=None,
        description="With `?next_lease=true`: the island's next lease, issued right after this upload was "
        "accepted, when one was ready at once (none after a retried upload, one that closed its round or made a "
        "module step due, or when there is no work now: then ask `POST /v1/islands/{id}/lease` as usual)",
    )


class LeaseModules(BaseModel):
    """`GET /v1/leases/{id}/modules`: the lease's modules at its base versions; `ready` once every one of them is
    stepped (an overlap lease's pending versions have landed), with the hash of each."""

    lease_id: int
    ready: bool
    modules: list[LeaseModule]


class LeaseReleased(BaseModel):
    """Reply to a release: the lease's state afterwards (`released`, or `expired` if it had run out)."""

    lease_id: int
    status: LeaseStatus


class ContributionModule(BaseModel):
    """One module's part of an accepted upload, and what the round's apply did with it."""

    module_id: int
    base_version: int | None = Field(default=None, description="The module version the lease trained from")
    staleness: int = Field(default=0, description="Module steps between that version and the step it joined")
    rebased_at: int | None = Field(
        default=None,
        description="Overlap leases: inner steps trained from the island's own end weights of the path before it "
        "moved onto the base version (which had not landed when the lease was issued); null: trained from the base "
        "version throughout",
    )
    norm: float | None = Field(description="L2 norm of the outer gradient, measured at upload")
    scale: float = Field(description="Factor it was folded in with: 1 as sent, < 1 clipped, 0 refused")
    note: str | None = Field(description="Why it was clipped or refused")


class ContributionSummary(BaseModel):
    id: int
    lease_id: int
    run_id: int
    round: int
    path_index: int
    island_id: int
    tokens: int
    train_loss: float
    heldout_loss: float | None = Field(default=None, description="The start weights' loss on the held-out slice")
    status: ContributionStatus
    created_at: datetime
    modules: list[ContributionModule] = Field(default_factory=list, description="Per module, in level order")
    codec: Codec = Field(default="fp32", description="The codec the upload was encoded with")
    upload_bytes: int = Field(default=0, description="Size of the upload as received")


# -- dashboard reads (the web dashboard at /ui/ and anything else that watches a run) --------------------------


class EventPublic(BaseModel):
    id: int = Field(description="Increasing; pass the largest seen as `after` to read only newer events")
    kind: EventKind
    run_id: int | None
    island_id: int | None
    lease_id: int | None
    round: int | None
    path_index: int | None
    detail: str
    created_at: datetime


class LeaseSummary(BaseModel):
    """A lease as the registry holds it (no shard or module details: see LeasePublic for the island's view)."""

    id: int
    run_id: int
    island_id: int
    round: int
    path_index: int
    status: LeaseStatus
    epoch: int
    token_start: int
    token_end: int
    issued_at: datetime
    expires_at: datetime
    inner_steps: int | None = Field(default=None, description="H of this lease when it is not the run's")
    first_step: int | None = Field(
        default=None, description="All-async runs: the global inner step its training starts at (the LR schedule)"
    )
    shared: bool = Field(
        default=False, description="Issued on a path another lease held (async path sharing, run field path_leases)"
    )
    pending_modules: list[int] | None = Field(
        default=None,
        description="Overlap leases: the modules issued at the version a due step will make, without weights (the "
        "island trains on from its own end weights and moves onto them when they land); null: none",
    )


class RunStats(BaseModel):
    """What a run has done so far, aggregated from its paths, rounds and leases."""

    run_id: int
    rounds_applied: int
    tokens_trained: int = Field(description="Sum over the run's paths")
    islands_active: int = Field(
        description="Live islands (active, heartbeated within 3 heartbeat intervals) that hold a pending lease of "
        "the run or, while it runs, trained one of its paths last"
    )
    latest_train_loss: float | None = Field(description="Mean train loss of the last applied round's contributions")
    mean_round_s: float | None = Field(description="Mean seconds from a round opening to its apply")
    last_round_s: float | None = Field(description="Seconds from the last applied round opening to its apply")


class PathLoss(BaseModel):
    """One accepted contribution, as the loss plot needs it."""

    path_index: int
    train_loss: float
    tokens: int
    island_id: int
    heldout_loss: float | None = Field(
        default=None,
        description="Loss of the path's weights at the start of this round (the modules' versions its lease got) on "
        "the path's held-out slice, scored by the island; null: not scored",
    )


class RoundHistory(BaseModel):
    number: int
    status: RoundStatus
    opened_at: datetime
    applied_at: datetime | None
    deadline: datetime | None
    quorum_paths: int = Field(description="Contributions that close the round once its deadline has passed")
    contributions: int
    refused_uploads: int = Field(description="Uploads refused for leases of this round (events)")
    lease_expiries: int = Field(description="Leases of this round that expired (events)")
    losses: list[PathLoss] = Field(description="Accepted contributions by path index")


class RunHistory(BaseModel):
    """A page of a run's rounds, oldest first, each with the train loss of every path that contributed."""

    run_id: int
    num_paths: int
    num_rounds: int
    current_round: int
    data: list[RoundHistory]
    count: int = Field(description="Rounds of the run so far (all pages)")


# -- direct transfers: islands PUT their outer gradients to the bucket, then commit them -------------------------


class UploadTicketRequest(BaseModel):
    """What the island is about to PUT: its size and sha256 (the name it will have once verified)."""

    model_config = STRICT
    size: int = Field(ge=8, le=DB_INT_MAX)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


MAX_PARTS = 10_000
"""S3's largest number of parts in one multipart upload."""


class UploadPart(BaseModel):
    """One part of a multipart direct upload: PUT bytes [offset, offset + size) of the body to `url` and keep the
    ETag the bucket answers with."""

    number: int = Field(description="1-based part number")
    offset: int
    size: int
    url: str


class UploadTicket(BaseModel):
    """Where to PUT the body, good until `expires_at`, and the key to commit: one pre-signed URL (`url`), or, for a
    body of at least the coordinator's `direct_multipart_bytes`, a multipart upload (`upload_id`) whose `parts`
    cover the body in order (each but the last at least 5 MiB, as S3 requires)."""

    url: str | None = Field(default=None, description="PUT the whole body here (None: a multipart upload)")
    key: str
    expires_at: datetime
    upload_id: str | None = Field(default=None, description="The multipart upload to commit the parts of")
    parts: list[UploadPart] = Field(default_factory=list)


class CommitPart(BaseModel):
    """A part of a multipart direct upload as the bucket took it: its number and the ETag its PUT answered."""

    model_config = STRICT
    number: int = Field(ge=1, le=MAX_PARTS)
    etag: str = Field(min_length=1, max_length=128, pattern=r'^"?[0-9A-Za-z-]+"?$')


class UploadCommit(BaseModel):
    """The upload is in the bucket: record it (the same checks as an upload through the coordinator; its values
    are verified by the apply executor before any math). A multipart upload names its `upload_id` and every part,
    numbered 1..N in order; the coordinator joins them before it reads the header."""

    model_config = STRICT
    key: str = Field(min_length=1, max_length=300)
    size: int = Field(ge=8, le=DB_INT_MAX)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    round: int = Field(ge=0, le=DB_INT_MAX)
    tokens: int = Field(ge=0, le=DB_INT_MAX)
    train_loss: float
    heldout_loss: float | None = None
    rebased_at: int | None = Field(default=None, ge=0, le=DB_INT_MAX, description="As `X-Dipaco-Rebased-At`")
    upload_id: str | None = Field(default=None, min_length=1, max_length=1024)
    parts: list[CommitPart] | None = Field(default=None, min_length=1, max_length=MAX_PARTS)

    @model_validator(mode="after")
    def _parts_of_one_upload(self) -> UploadCommit:
        if (self.upload_id is None) != (self.parts is None):
            raise ValueError("upload_id and parts go together (a multipart upload) or not at all (a single PUT)")
        numbers = [part.number for part in self.parts or []]
        if numbers != list(range(1, len(numbers) + 1)):
            shown = numbers if len(numbers) <= 10 else [*numbers[:10], "..."]
            raise ValueError(f"parts must be numbered 1..{len(numbers)} in order, got {shown}")
        return self
