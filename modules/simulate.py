"""In-process reference DiPaCo training (DiPaCo Alg. 1 with DiLoCo inner/outer steps): no HTTP, no DB.

The service must produce the same numbers for the same inputs; these are the exact conventions.

Initialisation
    `init_level_modules(cfg, layout, seed=seed)`: every module of a level starts as a copy of that level's
    weights (paper §2.2). Outer momentum starts absent (zeros) for every module.

Rounds (r = 0 .. rounds-1); inside a round paths run in index order, all from the weights at round start
    1. Path p composes its modules (`layout.path_modules(p)`) into its own persistent `PathModel` (the
       weights are copied into the existing parameters, so the inner optimizer keeps pointing at them).
    2. Token range: `need = H * B * T + 1` (B = inner.batch_size, T = cfg.seq_len). Path p has a cursor
       `off_p`, starting at 0. If `off_p + need > len(tokens[p])` the cursor wraps to 0 first. The round's
       range is `tokens[p][off_p : off_p + need]`, cut by `batches_from_tokens`, then `off_p += H * B * T`
       (ranges overlap by the one target token at their border).
    3. `torch.manual_seed(seed + p)`, then H AdamW steps via `train_steps(..., first_step=r * H)` (the
       schedule is indexed by the global inner step and continues across rounds).
    4. Inner state: one AdamW per path, created by `make_optimizer` before round 0 and kept across rounds
       (DiLoCo keeps the inner optimizer state on the worker); it is never reset or averaged.
    5. Outer gradient per level: `pseudo_gradient(module weights at round start, trained weights)`.
    6. The path's train loss for the round is the mean of its H step losses.
    After every path has trained, each module folds the outer gradients of the paths that use it into a
    `RoundAccumulator`, in path order, each with its outlier factor (`outlier_scales` of the L2 norms), and
    finishes it with `outer`. A contribution's weight is
    `path_weights[p]` when given (e.g. `alpha_weights` of shard sizes, §2.7), else `contribution_weight(outer,
    tokens)` with the H * B * T tokens it trained, exactly as the coordinator weighs an upload.
    Every module of the layout is used by at least one path, so every module steps every round.

Codec (`codec`, the run field): each worker's outer gradient goes through `encode_grad` with its own error
    feedback and back through `decode_grad` before the outer round, as an island's upload does (fp32: untouched).

Sparse rows (`sparse_rows`, the run field; `modules.sparse_rows`): the embed level's `tok_emb.weight` goes as
    the rows of the tokens in the inputs of the worker's batches of the round (`touched_rows`), through the
    codec and the worker's error feedback even with fp32 (the rows not sent wait in the residual), and each
    row is averaged over the workers that sent it.

Replicas (`replicas=R`, DiLoCo's data-parallel workers)
    Each path is trained by R workers per round; worker j of path p uses `tokens[p * R + j]`, its own model and
    AdamW, and seed `seed + p * R + j`. Each worker's outer gradient is one contribution (weight `path_weights[p]`).
    With a layout whose levels are all shared (one path) and R workers this is exactly DiLoCo (arXiv 2311.08105,
    Alg. 1). With R = 1 (the default) everything above is unchanged.

Async and hybrid schedules (`simulate_async`, `AsyncSettings`, events `Lease` and `Upload`)
    The reference for runs with async levels replays an arrival order of leases and uploads instead of rounds;
    its rules live in `modules.asynchrony` and are re-exported here, so both references are in this module. In
    round order, with periods of a module's users, it is `simulate` bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from modules.asynchrony import AsyncResult, AsyncSettings, Lease, Upload, simulate_async
from modules.codec import ErrorFeedback, GradCodec, received_grads
from modules.compose import compose_state, init_level_modules, split_state
from modules.config import ModelConfig
from modules.cursor import next_range
from modules.layout import Layout
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

__all__ = [
    "AsyncResult",
    "AsyncSettings",
    "Lease",
    "SimulationResult",
    "Upload",
    "next_range",
    "simulate",
    "simulate_async",
]


@dataclass(kw_only=True, slots=True)
class SimulationResult:
    losses: list[list[float]]
    """losses[r][p]: mean train loss of path p over its H inner steps of round r."""
    modules: list[list[Tensors]]
    """modules[level][module]: final weights."""
    momentum: list[list[Tensors | None]]
    """momentum[level][module]: final outer Nesterov buffer (None with `method="average"`)."""


def simulate(
    cfg: ModelConfig,
    layout: Layout,
    inner: InnerConfig,
    outer: OuterConfig,
    *,
    steps_per_round: int,
    rounds: int,
    seed: int,
    tokens: Sequence[torch.Tensor],
    path_weights: Sequence[float] | None = None,
    replicas: int = 1,
    codec: GradCodec = "fp32",
    sparse_rows: bool = False,
) -> SimulationResult:
    """Run `rounds` DiPaCo rounds of H = `steps_per_round` inner steps; `tokens[p * replicas + j]` is the shard of
    worker j of path p (with one replica: `tokens[p]` is path p's shard)."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    num_paths = layout.num_paths
    workers = num_paths * replicas
    if replicas == 1 and len(tokens) != num_paths:
        raise ValueError(f"need one token array per path: layout has {num_paths} paths, got {len(tokens)}")
    if len(tokens) != workers:
        raise ValueError(
            f"need one token array per worker: {num_paths} paths x {replicas} replicas = {workers}, got {len(tokens)}"
        )
    check_sparse_rows(cfg, sparse_rows=sparse_rows)
    if steps_per_round < 1 or rounds < 0:
        raise ValueError(f"steps_per_round must be >= 1 and rounds >= 0, got {steps_per_round}, {rounds}")
    trained_tokens = steps_per_round * inner.batch_size * cfg.seq_len  # per worker and round
    if path_weights is None:
        weights = [contribution_weight(outer, trained_tokens)] * num_paths
    else:
        weights = [float(w) for w in path_weights]
    if len(weights) != num_paths:
        raise ValueError(f"need one weight per path: {num_paths} paths, got {len(weights)}")

    init = init_level_modules(cfg, layout, seed=seed)
    modules: list[list[Tensors]] = [
        [{n: t.clone() for n, t in init[lv].items()} for _ in range(layout.num_modules(lv))]
        for lv in range(len(layout.levels))
    ]
    momentum: list[list[Tensors | None]] = [[None] * len(mods) for mods in modules]
    # worker w trains path w // replicas
    choice = [layout.path_modules(w // replicas) for w in range(workers)]
    models = [PathModel(cfg) for _ in range(workers)]
    optimizers = [make_optimizer(m, inner) for m in models]
    offsets = [0] * workers
    feedback = [ErrorFeedback() for _ in range(workers)]  # the codec's residual, kept per worker as islands do
    losses: list[list[float]] = []
    names = [level.name for level in layout.levels]

    for r in range(rounds):
        worker_losses: list[float] = []
        grads: list[list[Tensors]] = []  # grads[worker][level]
        for p in range(workers):
            base = [modules[lv][m] for lv, m in enumerate(choice[p])]
            models[p].load_state_dict(compose_state(base), strict=True)  # copies into the same parameters
            start, offsets[p] = next_range(
                offsets[p],
                length=tokens[p].numel(),
                steps=steps_per_round,
                batch_size=inner.batch_size,
                seq_len=cfg.seq_len,
            )
            batches = batches_from_tokens(
                tokens[p][start : start + steps_per_round * inner.batch_size * cfg.seq_len + 1],
                batch_size=inner.batch_size,
                seq_len=cfg.seq_len,
                steps=steps_per_round,
            )
            torch.manual_seed(seed + p)
            first = r * steps_per_round
            step_losses = train_steps(models[p], optimizers[p], batches, inner, first_step=first)
            worker_losses.append(sum(step_losses) / len(step_losses))
            trained = split_state({n: t.detach().clone() for n, t in models[p].state_dict().items()}, layout)
            outer_grads = [pseudo_gradient(base[lv], trained[lv]) for lv in range(len(base))]
            rows = touched_rows(batches, cfg.vocab_size) if sparse_rows else None
            grads.append(received_grads(outer_grads, names, codec, feedback[p], rows=rows))
        for lv, mods in enumerate(modules):
            for m in range(len(mods)):
                users = [w for w in range(workers) if choice[w][lv] == m]
                scales = outlier_scales([grad_norm(grads[w][lv]) for w in users], outer)
                acc = RoundAccumulator()
                for w, scale in zip(users, scales, strict=True):
                    acc.add(grads[w][lv], weights[w // replicas], scale=scale)
                mods[m], momentum[lv][m] = acc.finish(mods[m], momentum[lv][m], outer)
        # a path's loss is the mean over its workers
        losses.append([sum(worker_losses[p * replicas : (p + 1) * replicas]) / replicas for p in range(num_paths)])
    return SimulationResult(losses=losses, modules=modules, momentum=momentum)
