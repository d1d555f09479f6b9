"""Creating runs: model config, level layout, initial module weights (version 0), paths and round 0."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from coordinator.blobstore import BlobStore
from coordinator.errors import Conflict, Invalid, NotFound
from coordinator.models import Level, Module, ModuleVersion, Path, PathModule, Run
from coordinator.schemas import RunCreate
from coordinator.states import RunStatus
from modules import (
    InnerConfig,
    LayoutError,
    ModelConfig,
    flavour,
    grad_norm,
    init_level_modules,
    level_param_shapes,
    parse_layout,
)
from modules.asynchrony import AsyncSettings, period_size
from modules.layout import Layout, Mode
from modules.outer import Tensors
from modules.sparse_rows import check_sparse_rows


def model_config(spec: RunCreate) -> ModelConfig:
    try:
        base = flavour(spec.model.flavour).to_dict()
        base.update({k: v for k, v in spec.model.model_dump(exclude={"flavour"}).items() if v is not None})
        return ModelConfig.from_dict(base)
    except ValueError as exc:
        raise Invalid(f"model: {exc}") from exc


def run_model_config(run: Run) -> ModelConfig:
    return ModelConfig.from_dict(run.config["model"])


def run_layout(run: Run) -> Layout:
    return parse_layout(run.layout, n_layers=run.config["model"]["n_layers"])


def path_params(cfg: ModelConfig, layout: Layout) -> int:
    """Parameters of one path (shapes only: nothing is allocated)."""
    return sum(
        math.prod(shape)
        for level in range(len(layout.levels))
        for shape in level_param_shapes(cfg, layout, level).values()
    )


def tokens_per_lease(run: Run, steps: int | None = None) -> int:
    """Tokens one lease of `steps` inner steps (default: the run's H) reads: steps x batch x seq_len, plus one for
    the last target."""
    cfg = run.config
    return (steps or run.inner_steps) * cfg["inner"]["batch_size"] * cfg["model"]["seq_len"] + 1


def run_schedule(run: Run) -> AsyncSettings:
    """The run's update modes and async settings (runs created before async levels: all round)."""
    return schedule_from(run.config)


def schedule_from(config: dict[str, Any]) -> AsyncSettings:
    """`run_schedule` from a run's stored config (`Run.config`), for a reader that selected only that column."""
    schedule = config.get("schedule", {})
    return AsyncSettings(
        sync=schedule.get("sync", "round"),
        max_staleness=schedule.get("max_staleness", 4),
        damping=schedule.get("staleness_damping", "inverse"),
        dn_period=schedule.get("dn_period"),
        min_inner_steps=schedule.get("min_inner_steps"),
    )


def schedule_of(modes: list[str]) -> str:
    """`Run.schedule` from the levels' modes: round, async (no rounds: paths lease freely) or hybrid."""
    if all(mode == "async" for mode in modes):
        return "async"
    return "hybrid" if "async" in modes else "round"


DEFAULT_ASYNC_LR_FACTOR = 0.5
"""`outer.async_lr` of a run with async levels that does not set it, as a fraction of `outer.lr`: measured, half of
DiLoCo's 0.7 reaches round-sync's final perplexity sooner and matches it at equal tokens, where 0.7 does not
(docs/LOG.md, 2026-12-04)."""


DEFAULT_ASYNC_MOMENTUM = 0.6
"""`outer.async_momentum` of a run with async levels that does not set it: measured, with the halved step each
of 0.8, 0.7, 0.6 does better per token than the one before, from DiLoCo's 0.9, whose momentum carries the
overshoot of stale contributions; 0.6 beat round-sync at equal tokens on three seeds (docs/LOG.md, 2026-12-06)."""


def _outer(spec: RunCreate, modes: list[Mode]) -> dict[str, Any]:
    """The run's outer config as stored: `async_lr` and `async_momentum` resolved when a level is async (so a
    later change of the defaults never changes a run in flight), null otherwise."""
    outer = spec.outer.model_dump()
    if "async" in modes and outer["async_lr"] is None:
        outer["async_lr"] = outer["lr"] * DEFAULT_ASYNC_LR_FACTOR
    if "async" in modes and outer["async_momentum"] is None:
        outer["async_momentum"] = DEFAULT_ASYNC_MOMENTUM
    return outer


DEFAULT_PATH_LEASES = 2
"""`path_leases` of an all-async run that does not set it: measured, path sharing keeps the path of a slow island
from falling behind (docs/LOG.md, 2026-12-03)."""


DEFAULT_OVERLAP = True
"""`overlap` of an all-async run that does not set it: measured, islands idle 1.4-1.6 % of the wall time against
4.0-4.5 % when they wait for their path's steps, at 0.97-1.09x round-sync's perplexity at equal tokens against
1.00-1.05x (three seeds, docs/LOG.md 2026-12-06 session 2)."""


def overlap(run: Run) -> bool:
    """Whether an island of the run trains through its path's module step (`RunCreate.overlap`; runs before it:
    no)."""
    return bool(run.config.get("schedule", {}).get("overlap", False))


def path_leases(run: Run) -> int:
    """Leases that may train one path of the run at once (`RunCreate.path_leases`; runs before it: 1)."""
    return int(run.config.get("schedule", {}).get("path_leases", 1))


def inner_step_bounds(run: Run) -> tuple[int, int]:
    """(min, max) H of a lease: dynamic local updates when they differ."""
    schedule = run.config.get("schedule", {})
    return schedule.get("min_inner_steps") or run.inner_steps, schedule.get("max_inner_steps") or run.inner_steps


def weight_norm(weights: Tensors) -> float | None:
    """`Module.weight_norm`: the L2 norm of a module's weights, all tensors together (`modules.grad_norm` is that
    norm of any tensors); None when a value is not finite (never for a version the outer step let through)."""
    norm = grad_norm(weights)
    return norm if math.isfinite(norm) else None


def create_run(session: Session, blobs: BlobStore, spec: RunCreate, *, max_path_params: int) -> Run:
    """Register the run, its levels, modules (version 0, initialised here), paths; commit.

    A model over `max_path_params` parameters per path is refused before anything is allocated (creating a run
    initialises one whole path in this process)."""
    cfg = model_config(spec)
    try:
        layout = parse_layout(spec.layout, n_layers=cfg.n_layers)
    except LayoutError as exc:
        raise Invalid(f"layout: {exc}") from exc
    params = path_params(cfg, layout)
    if params > max_path_params:
        raise Invalid(
            f"model: a path of this model has {params:,} parameters, over the coordinator's budget of "
            f"{max_path_params:,} (DIPACO_MAX_PATH_PARAMS)"
        )
    if session.scalar(select(func.count()).select_from(Run).where(Run.name == spec.name)):
        raise Conflict(f"a run named {spec.name!r} already exists")
    try:
        check_sparse_rows(cfg, sparse_rows=spec.sparse_rows)
    except ValueError as exc:
        raise Invalid(str(exc)) from exc
    modes = layout.modes(spec.sync)
    if spec.min_inner_steps is not None and "round" in modes:
        raise Invalid(
            "min_inner_steps/max_inner_steps (dynamic local updates) need every level async: set sync to async "
            "and drop the ':round' levels of the layout"
        )
    unused = [f"outer.{k}" for k in ("async_lr", "async_momentum") if getattr(spec.outer, k) is not None]
    if unused and "async" not in modes:
        raise Invalid(
            f"{' and '.join(unused)} step the modules of async levels, and this run has none: set sync to async, "
            "mark levels ':async' in the layout, or leave them out (round levels use outer.lr and outer.momentum)"
        )
    if spec.path_leases is not None and spec.path_leases > 1 and "round" in modes:
        raise Invalid(
            f"path_leases ({spec.path_leases}) > 1 (path sharing) needs every level async: set sync to async and "
            "drop the ':round' levels of the layout"
        )
    if spec.overlap and "round" in modes:
        raise Invalid(
            "overlap (training through a path's module step) needs every level async: set sync to async and drop "
            "the ':round' levels of the layout"
        )
    if 0 < spec.heldout_tokens <= cfg.seq_len:
        raise Invalid(
            f"heldout_tokens ({spec.heldout_tokens}) must be 0 (keep no held-out slices) or at least one scoring "
            f"window of seq_len + 1 = {cfg.seq_len + 1} tokens"
        )
    inner = InnerConfig(**spec.inner.model_dump(), total_steps=spec.num_rounds * spec.inner_steps)
    config: dict[str, Any] = {
        "model": cfg.to_dict(),
        "inner": dataclasses.asdict(inner),
        "outer": _outer(spec, modes),
        "codec": spec.codec,
        "sparse_rows": spec.sparse_rows,
        "heldout_tokens": spec.heldout_tokens,
        "schedule": {
            "sync": spec.sync,
            "max_staleness": spec.max_staleness,
            "staleness_damping": spec.staleness_damping,
            "dn_period": spec.dn_period,
            "min_inner_steps": spec.min_inner_steps,
            "max_inner_steps": spec.max_inner_steps,
            "path_leases": spec.path_leases or (DEFAULT_PATH_LEASES if "round" not in modes else 1),
            "overlap": ("round" not in modes) and (DEFAULT_OVERLAP if spec.overlap is None else spec.overlap),
        },
    }
    run = Run(
        name=spec.name,
        status=RunStatus.WAITING_FOR_SHARDS,
        layout=layout.spec(),
        config=config,
        num_paths=layout.num_paths,
        inner_steps=spec.inner_steps,
        num_rounds=spec.num_rounds,
        current_round=0,
        seed=spec.seed,
        lease_ttl_s=spec.lease_ttl_s,
        max_lease_s=spec.max_lease_s,
        quorum=spec.quorum,
        round_deadline_s=spec.round_deadline_s,
        schedule=schedule_of(list(modes)),
    )
    session.add(run)
    session.flush()
    init = init_level_modules(cfg, layout, seed=spec.seed)
    choices = [layout.path_modules(p) for p in range(layout.num_paths)]
    users_of = [Counter(choice[li] for choice in choices) for li in range(len(layout.levels))]
    module_ids: list[list[int]] = []
    for li, level in enumerate(layout.levels):
        row = Level(
            run_id=run.id,
            index=li,
            name=level.name,
            sharing=level.sharing,
            num_modules=layout.num_modules(li),
            mode=modes[li],
        )
        session.add(row)
        session.flush()
        digest = blobs.put_tensors(init[li])
        num_params = sum(t.numel() for t in init[li].values())
        norm = weight_norm(init[li])  # the level's modules all start from the same weights
        ids = []
        for mi in range(layout.num_modules(li)):
            users = users_of[li][mi]
            module = Module(
                run_id=run.id,
                level_id=row.id,
                level_index=li,
                index=mi,
                version=0,
                weights_hash=digest,
                momentum_hash=None,
                num_params=num_params,
                weight_norm=norm,
                period_size=period_size(users, spec.dn_period) if modes[li] == "async" else None,
            )
            session.add(module)
            session.flush()
            session.add(ModuleVersion(module_id=module.id, version=0, weights_hash=digest, round=None))
            ids.append(module.id)
        module_ids.append(ids)
    for p, choice in enumerate(choices):
        path = Path(run_id=run.id, index=p)
        session.add(path)
        session.flush()
        for li, mi in enumerate(choice):
            session.add(PathModule(path_id=path.id, level_index=li, module_id=module_ids[li][mi]))
    try:
        session.commit()
    except IntegrityError as exc:
        session.rollback()
        raise Conflict(f"a run named {spec.name!r} already exists") from exc
    return run


def get_run(session: Session, run_id: int) -> Run:
    run = session.get(Run, run_id)
    if run is None:
        raise NotFound(f"run {run_id} does not exist")
    return run
