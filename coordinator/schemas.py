"""Wire schemas shared by the coordinator and the island client. Imports only pydantic.

Tensors never travel as JSON: module weights, shard tokens and outer gradients are raw bodies
(safetensors or little-endian uint16 token files) addressed by sha256 content hash.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from coordinator.states import ContributionStatus, IslandStatus, LeaseStatus, RoundStatus, RunStatus

T = TypeVar("T")

# Header names used on raw-body requests and responses.
H_ROUND = "X-Dipaco-Round"
"""Upload: the round the island trained for (must equal the lease's round)."""
H_TOKENS = "X-Dipaco-Tokens"
"""Upload: number of tokens the island trained on for this lease."""
H_TRAIN_LOSS = "X-Dipaco-Train-Loss"
"""Upload: mean inner training loss of the lease (float)."""
H_CONTENT_HASH = "X-Dipaco-Content-Sha256"
"""Download: sha256 of the body (also sent as the ETag)."""
H_IDLE = "X-Dipaco-Idle"
"""Lease 204: `waiting` (work may come; honour Retry-After) or `no-running-runs`."""
H_HELD = "X-Dipaco-Held-Ms"
"""How long a long-polled lease request was held with no work (milliseconds)."""
IdleReason = Literal["waiting", "no-running-runs"]
"""Values of `H_IDLE`."""

# Outer gradient upload: one safetensors file whose tensor names are f"{level_name}/{param_name}",
# one entry for every parameter of every module on the leased path, dtype F32, same shapes as the module.
GRAD_KEY_SEP = "/"


class ListOf(BaseModel, Generic[T]):
    data: list[T]
    count: int


class ModelSpec(BaseModel):
    """Fields of `modules.ModelConfig`; unset fields take the flavour's value."""

    model_config = ConfigDict(extra="forbid")
    flavour: str = "debug"
    vocab_size: int | None = Field(default=None, ge=2, le=65535)
    seq_len: int | None = Field(default=None, ge=2, le=8192)
    d_model: int | None = Field(default=None, ge=8)
    n_layers: int | None = Field(default=None, ge=1)
    n_heads: int | None = Field(default=None, ge=1)
    mlp_ratio: int | None = Field(default=None, ge=1)


class InnerSpec(BaseModel):
    """Inner AdamW settings (see `modules.InnerConfig`); total_steps is set to rounds * inner_steps."""

    model_config = ConfigDict(extra="forbid")
    lr: float = Field(default=3e-3, gt=0)
    min_lr_ratio: float = Field(default=0.1, ge=0, le=1)
    warmup_steps: int = Field(default=10, ge=0)
    weight_decay: float = Field(default=0.1, ge=0)
    beta1: float = Field(default=0.9, ge=0, lt=1)
    beta2: float = Field(default=0.95, ge=0, lt=1)
    grad_clip: float = Field(default=1.0, ge=0)
    batch_size: int = Field(default=8, ge=1, le=4096)


class OuterSpec(BaseModel):
    """Outer optimizer of every module (see `modules.OuterConfig`, the one home of the outer round)."""

    model_config = ConfigDict(extra="forbid")
    lr: float = Field(default=0.7, gt=0, description="Outer learning rate (DiLoCo: 0.7)")
    momentum: float = Field(default=0.9, ge=0, lt=1, description="Nesterov momentum (DiLoCo: 0.9)")
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


class RunCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=200)
    model: ModelSpec = ModelSpec()
    layout: str = Field(
        default="embed:shared, b0-0:routed2, b1-1:routed2, head:shared",
        description="Level layout, see modules.layout",
    )
    inner: InnerSpec = InnerSpec()
    outer: OuterSpec = OuterSpec()
    inner_steps: int = Field(default=20, ge=1, le=1_000_000, description="H: inner steps per round")
    num_rounds: int = Field(default=3, ge=1, le=1_000_000)
    seed: int = Field(default=0, ge=0)
    lease_ttl_s: float = Field(default=120.0, gt=0, description="Lease expiry without heartbeats")
    quorum: float = Field(
        default=1.0, gt=0, le=1, description="Fraction of paths that must contribute to close a round past its deadline"
    )
    round_deadline_s: float | None = Field(
        default=None, gt=0, description="Seconds after a round opens after which quorum suffices; None: wait for all"
    )


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
    quorum: float
    round_deadline_s: float | None
    created_at: datetime


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
    version: int
    weights_hash: str
    num_params: int
    updated_at: datetime


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
    model_config = ConfigDict(extra="forbid")
    device: str = Field(default="cpu", max_length=64)
    memory_bytes: int | None = Field(default=None, ge=0)
    tokens_per_s: float | None = Field(default=None, ge=0)


class IslandJoin(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=200)
    site: str = Field(default="local", max_length=200)
    capabilities: IslandCapabilities = IslandCapabilities()


class IslandJoined(BaseModel):
    island_id: int
    token: str = Field(description="Island bearer token; shown once, stored hashed")
    heartbeat_interval_s: float


class IslandPublic(BaseModel):
    id: int
    name: str
    site: str
    status: IslandStatus
    capabilities: IslandCapabilities
    last_heartbeat: datetime | None
    created_at: datetime


class HeartbeatReply(BaseModel):
    island_id: int
    active_lease_ids: list[int]
    heartbeat_interval_s: float


class LeaseModule(BaseModel):
    level: int
    level_name: str
    module_id: int
    version: int
    weights_hash: str


class LeaseShard(BaseModel):
    shard_id: int
    tokens_hash: str
    num_tokens: int


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
    token_start: int = Field(description="First token (inclusive) of the range in the shard")
    token_end: int = Field(description="Last token (exclusive); end - start = H * batch * seq_len + 1")
    epoch: int
    seed: int
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
    status: ContributionStatus
    round_applied: bool = Field(description="Whether this upload completed the round")


class LeaseReleased(BaseModel):
    """Reply to a release: the lease's state afterwards (`released`, or `expired` if it had run out)."""

    lease_id: int
    status: LeaseStatus


class ContributionSummary(BaseModel):
    id: int
    lease_id: int
    run_id: int
    round: int
    path_index: int
    island_id: int
    tokens: int
    train_loss: float
    status: ContributionStatus
    created_at: datetime
