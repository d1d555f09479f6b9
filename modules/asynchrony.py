"""Asynchronous and hybrid outer updates: the rules, and the in-process reference the service must equal.

A level is updated either per **round** (DiPaCo/DiLoCo as in `modules.simulate`: when every path has contributed
to a round, each module folds the outer gradients of the paths that used it) or **async** (a module advances on
the contributions it receives, whoever sends them and whenever). For an async module:

Periods (Delayed Nesterov, arXiv 2401.09135)
    Accepted contributions are buffered; every `period_size` of them (the run's `dn_period`, by default the
    number of paths that use the module) the module takes one outer step on the buffer: the same fold as a
    round (`RoundAccumulator`, outlier factors of the buffered norms, Nesterov momentum updated once), so the
    momentum moves once per period rather than once per contribution, and in between the contributions are
    only averaged. With `dn_period` = the module's users and every path contributing once per period from the
    weights of the previous step, this is exactly the round schedule. The step's learning rate is the outer
    config's `async_lr` (`OuterConfig.for_async`): with about every other part one step stale, DiLoCo's 0.7
    overshoots and its momentum carries the overshoot, and half of it did better per token than round-sync
    (docs/LOG.md, 2026-12-04), so the coordinator's runs default to half of `lr`; likewise the momentum is the
    config's `async_momentum`, 0.6 by default in the coordinator's runs (docs/LOG.md, 2026-12-06).
    (2401.09135 also takes small momentum-free steps between two momentum steps, its factor c; here c = 0: the
    module does not move between steps.)
Versions and staleness
    A module's version is the number of its periods applied (an async step always makes a new version, even
    one whose contributions were all left out). A contribution that joins period p, trained from base
    version b, has staleness s = p - b: how many steps the module took since the weights it trained from. It
    is known when the contribution is accepted (steps of a module apply in period order).
Damping
    A contribution with s > `max_staleness` is refused; the others enter the fold with their outlier factor
    times `staleness_weight(s)`: 1 / (1 + s) by default (`inverse`), 1 / (1 + s)^2 (`inverse_square`), or 1
    (`none`). The factor scales the
    contribution but not the weight total it is divided by, so a stale contribution moves the module less.
End of the run
    When no more contributions will come (every path spent its budget, or the last round closed), each module
    with a partly filled period takes one last step on what it has.

`simulate_async` replays a schedule of lease and upload events (deterministic for a given order): a lease
takes the modules' current weights and, unless it names its range, the path's next one (`modules.cursor`: with
every level async a lease that does not fit takes the shard's tail with fewer steps, as the service's do); its
upload trains H steps from them, then joins each async module's current period (a filled period steps at once)
and each round module's round (applied when every path has contributed). The service holds back a lease on a
module whose step is waiting for an executor, so for the same order it sees the same versions. An overlap lease
(`Lease.through`: the service issued it at versions a due step was still to make) starts those levels from the
island's own end weights of the path and moves onto the versions before inner step `Lease.rebase_at`, as the
island reported (`rebase`); the versions are read at its upload.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Literal

import torch

from modules.codec import ErrorFeedback, GradCodec, received_grads
from modules.compose import compose_state, init_level_modules, split_state
from modules.config import ModelConfig
from modules.cursor import fitting_steps, next_range
from modules.layout import Layout, Mode
from modules.model import PathModel
from modules.outer import (
    OuterConfig,
    RoundAccumulator,
    contribution_weight,
    grad_norm,
    outlier_scales,
    pseudo_gradient,
)
from modules.sparse_rows import check_sparse_rows, touched_rows
from modules.train import InnerConfig, batches_from_tokens, make_optimizer, train_steps

Tensors = dict[str, torch.Tensor]
Damping = Literal["inverse", "inverse_square", "none"]
DAMPINGS: tuple[Damping, ...] = ("inverse", "inverse_square", "none")


def staleness_weight(staleness: int, damping: Damping = "inverse") -> float:
    """The factor a contribution of staleness `staleness` enters its module's fold with: 1/(1+s), 1/(1+s)^2, or
    1."""
    if staleness < 0:
        raise ValueError(f"staleness must be >= 0, got {staleness}")
    if damping == "inverse":
        return 1.0 / (1 + staleness)
    if damping == "inverse_square":
        return 1.0 / (1 + staleness) ** 2
    if damping == "none":
        return 1.0
    raise ValueError(f"unknown staleness damping {damping!r}; use one of {', '.join(DAMPINGS)}")


def period_size(users: int, dn_period: int | None) -> int:
    """Contributions per outer step of an async module used by `users` paths (`dn_period`, else `users`)."""
    if users < 1:
        raise ValueError(f"a module needs at least one path using it, got {users}")
    return dn_period if dn_period is not None else users


@dataclass(kw_only=True, slots=True)
class AsyncSettings:
    """The run fields that shape asynchronous updates (RunCreate: sync, max_staleness, ...)."""

    sync: Mode = "round"
    """Default update mode of a level; the layout may override it per level."""
    max_staleness: int = 4
    damping: Damping = "inverse"
    dn_period: int | None = None
    min_inner_steps: int | None = None
    """All-async runs: the fewest inner steps a lease takes the tail of a shard with (`modules.cursor.fitting_steps`;
    None: 1)."""


@dataclass(frozen=True, slots=True)
class Lease:
    """A lease event: path `path` takes its modules' current weights to train `steps` inner steps on island
    `island` (an island keeps its own inner AdamW state and codec residual per path, as `dipaco island join`
    does: a path that moves to another island starts there from a fresh optimizer)."""

    path: int
    steps: int
    island: int = 0
    versions: tuple[int, ...] | None = None
    """The module versions (one per level) the lease trains from; None: the current ones. A replay of a service
    run names them, so the order of lease events among uploads does not matter."""
    start: int | None = None
    """The first token of its range; None: where the path's accepted leases end (one lease per path at once),
    and with every level async a lease that does not fit in the rest of the shard takes the tail with fewer steps
    (`modules.cursor.fitting_steps`)."""
    first_step: int | None = None
    """Its first global inner step (the LR schedule); None: the path's accepted steps."""
    key: int | None = None
    """Names the lease among several that hold its path at once (path sharing); its `Upload` names it too."""
    through: tuple[int, ...] = ()
    """An overlap lease (run field `overlap`): the levels whose `versions` a due step was still to make when it was
    issued. They start from the island's own end weights of the path (its last accepted upload of it) and move
    onto their versions, by (version - end weights), before inner step `rebase_at`; their versions must exist by
    its upload, and its outer gradient is taken against them."""
    rebase_at: int | None = None
    """With `through`: the inner steps trained before the move (0..steps: `steps` moves after the last one)."""


@dataclass(frozen=True, slots=True)
class Upload:
    """An upload event: path `path` hands in the lease it holds (the one named `key`)."""

    path: int
    key: int | None = None


@dataclass(kw_only=True, slots=True)
class Accepted:
    """One upload as the coordinator saw it."""

    path: int
    loss: float
    tokens: int
    start: int
    """The first token of its range."""
    steps: int
    """Its inner steps (fewer than its lease event's when it took a shard's tail)."""
    base_versions: list[int]
    """Per level: the version of the path's module its lease trained from."""
    staleness: list[int]
    """Per level: s = period joined - base version (0 on round levels)."""
    refused: str | None = None
    """Why it was refused (staleness over the bound); a refused upload changes nothing."""


@dataclass(kw_only=True, slots=True)
class AsyncResult:
    uploads: list[Accepted]
    modules: list[list[Tensors]]
    momentum: list[list[Tensors | None]]
    versions: list[list[int]]


@dataclass(slots=True)
class _Part:
    path: int
    seq: int
    grad: Tensors
    tokens: int
    staleness: int


@dataclass(slots=True)
class _Module:
    weights: Tensors
    momentum: Tensors | None = None
    version: int = 0
    users: int = 0
    buffer: list[_Part] = field(default_factory=list)
    history: list[Tensors] = field(default_factory=list)
    """Weights of every version, for leases that name theirs."""


@dataclass(slots=True)
class _Trainer:
    """What an island keeps for one path: the model it trains in, the inner AdamW, the codec's residual."""

    model: PathModel
    optimizer: torch.optim.AdamW
    feedback: ErrorFeedback


@dataclass(slots=True)
class _PathState:
    offset: int = 0
    steps_done: int = 0
    leases_done: int = 0
    leases: dict[int | None, _HeldLease] = field(default_factory=dict)


@dataclass(slots=True)
class _HeldLease:
    steps: int
    start: int
    base: list[Tensors | None]
    """None for the levels of `through`: their versions are read at the upload."""
    versions: list[int]
    round: int
    island: int
    first_step: int | None
    through: tuple[int, ...] = ()
    rebase_at: int | None = None


def fold(
    module: _Module, parts: Sequence[_Part], outer: OuterConfig, damping: Damping
) -> tuple[Tensors, Tensors | None]:
    """One outer step of a module over `parts` (path order, then arrival): outlier factors of their norms times
    the staleness factor, the module's Nesterov momentum updated once."""
    ordered = sorted(parts, key=lambda part: (part.path, part.seq))
    scales = outlier_scales([grad_norm(part.grad) for part in ordered], outer)
    acc = RoundAccumulator()
    for part, scale in zip(ordered, scales, strict=True):
        acc.add(
            part.grad,
            contribution_weight(outer, part.tokens),
            scale=scale * staleness_weight(part.staleness, damping),
        )
    return acc.finish(module.weights, module.momentum, outer)


def _check_through(event: Lease, steps: int, levels: int) -> None:
    if not event.through:
        if event.rebase_at is not None:
            raise ValueError(f"lease of path {event.path}: rebase_at without levels to move (through)")
        return
    if any(not 0 <= lv < levels for lv in event.through) or len(set(event.through)) != len(event.through):
        raise ValueError(f"lease of path {event.path}: through {event.through} are not distinct levels of the path")
    if event.rebase_at is None or not 0 <= event.rebase_at <= steps:
        raise ValueError(f"lease of path {event.path}: rebase_at must be in [0, {steps}], got {event.rebase_at}")


def _landed(lease: _HeldLease, mine: list[_Module], path: int) -> list[Tensors]:
    """The lease's base weights per level, the versions of `through` read now (they must have landed)."""
    out = []
    for lv, (held, version, module) in enumerate(zip(lease.base, lease.versions, mine, strict=True)):
        if held is not None:
            out.append(held)
        elif version <= module.version:
            out.append(module.history[version])
        else:
            raise ValueError(
                f"path {path} uploads an overlap lease before version {version} of its level {lv} landed "
                f"(the module is at {module.version})"
            )
    return out


def _start_weights(lease: _HeldLease, landed: list[Tensors], end: list[Tensors] | None, path: int) -> list[Tensors]:
    """Where the lease's training starts: its base weights, or for `through` the island's end weights of the path."""
    if not lease.through:
        return landed
    if end is None:
        raise ValueError(f"island {lease.island} has no end weights of path {path} to start an overlap lease from")
    return [end[lv] if lv in lease.through else weights for lv, weights in enumerate(landed)]


@torch.no_grad()
def rebase(model: PathModel, moves: Sequence[tuple[Tensors, Tensors]]) -> None:
    """An overlap lease's move: for each (landed, start) pair of a module's weights, add landed - start to its
    parameters in `model`, in place (on their device and dtype), so the model holds the landed version plus what
    the steps so far trained from `start`. The island (`island.worker._Rebase`) and the reference both do this."""
    state = model.state_dict()
    for new, old in moves:
        for name, tensor in new.items():
            param = state[name]
            param.add_(tensor.to(param.device, param.dtype) - old[name].to(param.device, param.dtype))


def _move_at(at: int | None, model: PathModel, moves: list[tuple[Tensors, Tensors]], step: int) -> None:
    if step == at:
        rebase(model, moves)


def simulate_async(
    cfg: ModelConfig,
    layout: Layout,
    inner: InnerConfig,
    outer: OuterConfig,
    settings: AsyncSettings,
    *,
    events: Sequence[Lease | Upload],
    budget_steps: int,
    seed: int,
    tokens: Sequence[torch.Tensor],
    codec: GradCodec = "fp32",
    sparse_rows: bool = False,
) -> AsyncResult:
    """Replay `events` (leases and uploads in the order the coordinator saw them) on a run of `budget_steps`
    inner steps per path; every path must spend its budget (or, with round levels, every round close)."""
    num_paths = layout.num_paths
    if len(tokens) != num_paths:
        raise ValueError(f"need one token array per path: layout has {num_paths} paths, got {len(tokens)}")
    check_sparse_rows(cfg, sparse_rows=sparse_rows)
    modes = layout.modes(settings.sync)
    init = init_level_modules(cfg, layout, seed=seed)
    choice = [layout.path_modules(p) for p in range(num_paths)]
    modules: list[list[_Module]] = [
        [_Module(weights={n: t.clone() for n, t in init[lv].items()}) for _ in range(layout.num_modules(lv))]
        for lv in range(len(layout.levels))
    ]
    for p in range(num_paths):
        for lv, m in enumerate(choice[p]):
            modules[lv][m].users += 1
    paths = [_PathState() for _ in range(num_paths)]
    names = [level.name for level in layout.levels]
    trainers: dict[tuple[int, int], _Trainer] = {}
    ends: dict[tuple[int, int], list[Tensors]] = {}
    """(island, path): the trained weights per level of the island's last accepted upload of the path."""

    def trainer(island: int, path: int) -> _Trainer:
        if (island, path) not in trainers:
            model = PathModel(cfg)
            trainers[island, path] = _Trainer(model, make_optimizer(model, inner), ErrorFeedback())
        return trainers[island, path]

    has_rounds = "round" in modes
    current_round = 0
    round_parts: dict[tuple[int, int], list[_Part]] = {}
    round_paths: set[int] = set()
    uploads: list[Accepted] = []
    seq = 0

    for level in modules:
        for module in level:
            module.history.append(module.weights)

    def step_async(lv: int, m: int) -> None:
        module = modules[lv][m]
        module.weights, module.momentum = fold(module, module.buffer, outer.for_async(), settings.damping)
        module.buffer = []
        module.version += 1
        module.history.append(module.weights)

    for event in events:
        state = paths[event.path]
        if isinstance(event, Lease):
            if event.key in state.leases:
                named = "a lease" if event.key is None else f"lease {event.key}"
                raise ValueError(f"path {event.path} already holds {named}")
            start, steps = event.start, event.steps
            if start is None:
                length = tokens[event.path].numel()
                fitted = 0 if has_rounds else fitting_steps(  # round leases keep the round's H and wrap
                    state.offset, length=length, steps=steps, per_step=inner.batch_size * cfg.seq_len,
                    min_steps=settings.min_inner_steps,
                )  # fmt: skip
                if fitted:
                    start, steps = state.offset, fitted
                else:
                    start, _ = next_range(
                        state.offset, length=length, steps=steps, batch_size=inner.batch_size, seq_len=cfg.seq_len
                    )
            mine = [modules[lv][m] for lv, m in enumerate(choice[event.path])]
            versions = list(event.versions) if event.versions is not None else [mod.version for mod in mine]
            _check_through(event, steps, len(mine))
            if len(versions) != len(mine) or any(
                not 0 <= v <= mod.version and not (lv in event.through and v >= 0)
                for lv, (v, mod) in enumerate(zip(versions, mine, strict=True))
            ):
                raise ValueError(f"lease of path {event.path}: versions {versions} do not exist")
            base: list[Tensors | None] = [
                None if lv in event.through else mod.history[v]
                for lv, (v, mod) in enumerate(zip(versions, mine, strict=True))
            ]
            state.leases[event.key] = _HeldLease(
                steps=steps, start=start, base=base, versions=versions, round=current_round,
                island=event.island, first_step=event.first_step, through=event.through, rebase_at=event.rebase_at,
            )  # fmt: skip
            continue
        lease = state.leases.pop(event.key, None)
        if lease is None:
            named = "a lease" if event.key is None else f"lease {event.key}"
            raise ValueError(f"path {event.path} uploads without {named}")
        work = trainer(lease.island, event.path)
        snapshot = (copy.deepcopy(work.optimizer.state_dict()), copy.deepcopy(work.feedback.residual))
        mine = [modules[lv][m] for lv, m in enumerate(choice[event.path])]
        landed = _landed(lease, mine, event.path)
        start_weights = _start_weights(lease, landed, ends.get((lease.island, event.path)), event.path)
        work.model.load_state_dict(compose_state(start_weights), strict=True)
        span = lease.steps * inner.batch_size * cfg.seq_len
        batches = batches_from_tokens(
            tokens[event.path][lease.start : lease.start + span + 1],
            batch_size=inner.batch_size, seq_len=cfg.seq_len, steps=lease.steps,
        )  # fmt: skip
        first_step = state.steps_done if lease.first_step is None else lease.first_step

        moves = [(landed[lv], start_weights[lv]) for lv in lease.through]  # as the island's `_Rebase`
        move = partial(_move_at, lease.rebase_at if moves else None, work.model, moves)
        losses = train_steps(work.model, work.optimizer, batches, inner, first_step=first_step, before_step=move)
        move(lease.steps)
        trained = split_state({n: t.detach().clone() for n, t in work.model.state_dict().items()}, layout)
        grads = received_grads(
            [pseudo_gradient(landed[lv], trained[lv]) for lv in range(len(landed))],
            names, codec, work.feedback, rows=touched_rows(batches, cfg.vocab_size) if sparse_rows else None,
        )  # fmt: skip
        staleness = [
            modules[lv][m].version - lease.versions[lv] if modes[lv] == "async" else 0
            for lv, m in enumerate(choice[event.path])
        ]
        record = Accepted(
            path=event.path,
            loss=sum(losses) / len(losses),
            tokens=span,
            start=lease.start,
            steps=lease.steps,
            base_versions=list(lease.versions),
            staleness=staleness,
        )
        uploads.append(record)
        worst = max(staleness)
        if worst > settings.max_staleness:
            record.refused = f"staleness {worst} over max_staleness {settings.max_staleness}"
            work.optimizer.load_state_dict(snapshot[0])  # the island keeps its state only when accepted
            work.feedback.residual = snapshot[1]
            continue
        if has_rounds and lease.round != current_round:
            raise ValueError(f"path {event.path} uploads for round {lease.round}, the run is at {current_round}")
        ends[lease.island, event.path] = trained
        state.offset = lease.start + span
        state.steps_done += lease.steps
        state.leases_done += 1
        seq += 1
        for lv, m in enumerate(choice[event.path]):
            part = _Part(path=event.path, seq=seq, grad=grads[lv], tokens=span, staleness=staleness[lv])
            if modes[lv] == "async":
                module = modules[lv][m]
                module.buffer.append(part)
                if len(module.buffer) >= period_size(module.users, settings.dn_period):
                    step_async(lv, m)
            else:
                round_parts.setdefault((lv, m), []).append(part)
        if has_rounds:
            round_paths.add(event.path)
            if len(round_paths) == num_paths:
                for (lv, m), parts in sorted(round_parts.items()):
                    module = modules[lv][m]
                    module.weights, module.momentum = fold(module, parts, outer, settings.damping)
                    module.version += 1
                    module.history.append(module.weights)
                round_parts, round_paths = {}, set()
                current_round += 1
    unfinished = [p for p, state in enumerate(paths) if state.steps_done < budget_steps]
    if unfinished:
        raise ValueError(f"paths {unfinished} did not spend their budget of {budget_steps} steps")
    for lv, level_modules in enumerate(modules):
        for m, module in enumerate(level_modules):
            if module.buffer:
                step_async(lv, m)
    return AsyncResult(
        uploads=uploads,
        modules=[[module.weights for module in level] for level in modules],
        momentum=[[module.momentum for module in level] for level in modules],
        versions=[[module.version for module in level] for level in modules],
    )
