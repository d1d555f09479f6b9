"""The outer step of one large module, against the formulation it replaced (kept below as the baseline), in
one run, alternated:

1. arithmetic: `modules.RoundAccumulator` + `grad_norm` against the out-of-place formulation;
2. storing the new version (weights and momentum): `LocalBlobStore.put_tensors` (safetensors pieces hashed and
   written as they are) against `put_bytes(encode(...))` (the whole payload built in memory first), into a blob
   directory on the same disk as the coordinator's (`--blob-dir`, default a temporary one under /tmp).

One module of a flavour's whole path (paper-150m: 117M parameters, 75 tensors), P contributions with uniform or
token weights, a momentum buffer: fold the P outer gradients, finish (mean, Nesterov step, the finite checks),
then the new weights' L2 norm (`Module.weight_norm`). Prints the median time of each and the ratio, and checks
that both give the same weights and momentum bit for bit (the norms within 1e-12 relative: the chunked float64
sum adds in another order).

    .venv/bin/python bench/bench_outer_step.py [--flavour paper-150m] [--paths 2] [--reps 5] [--weighting tokens]
                                               [--blob-dir DIR]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from coordinator.blobstore import LocalBlobStore
from modules import OuterConfig, RoundAccumulator, encode, flavour, grad_norm, init_state

Tensors = dict[str, torch.Tensor]


def baseline(
    params: Mapping[str, torch.Tensor],
    momentum: Mapping[str, torch.Tensor],
    grads: list[Tensors],
    weights: list[float],
    cfg: OuterConfig,
) -> tuple[Tensors, Tensors, float]:
    """The formulation before 2026-12-04: a new sum per contribution, a new mean, six temporaries per tensor in
    the Nesterov step, boolean copies for the finite checks, the norm over whole float64 copies."""
    acc: Tensors | None = None
    for grad, w in zip(grads, weights, strict=True):
        if acc is None:
            acc = {n: t.float() * w for n, t in grad.items()}
        else:
            acc = {n: acc[n] + grad[n].float() * w for n in acc}
    assert acc is not None
    total = float(sum(weights))
    avg = {n: t / total for n, t in acc.items()}
    new: Tensors = {}
    mom: Tensors = {}
    for n, p in params.items():
        g = avg[n].float()
        buf = momentum[n].float() * cfg.momentum + g
        update = g + cfg.momentum * buf
        new[n] = (p.float() - cfg.lr * update).to(p.dtype)
        mom[n] = buf
    for tensors in (new, mom):
        assert all(bool(torch.isfinite(t).all()) for t in tensors.values())
    norm = math.sqrt(sum(float(torch.sum(t.double() ** 2)) for t in new.values()))
    return new, mom, norm


def product(
    params: Mapping[str, torch.Tensor],
    momentum: Mapping[str, torch.Tensor],
    grads: list[Tensors],
    weights: list[float],
    cfg: OuterConfig,
) -> tuple[Tensors, Tensors, float]:
    acc = RoundAccumulator()
    for grad, w in zip(grads, weights, strict=True):
        acc.add(grad, w)
    new, mom = acc.finish(params, momentum, cfg)
    assert mom is not None
    return new, mom, grad_norm(new)


def alternate(runs: dict[str, Callable[[], object]], reps: int) -> tuple[dict[str, list[float]], dict[str, object]]:
    """Each run once per repetition, the order rotated; repetition 0 warms up and is not timed."""
    secs: dict[str, list[float]] = {k: [] for k in runs}
    out: dict[str, object] = {}
    names = list(runs)
    for rep in range(reps + 1):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            t0 = time.perf_counter()
            out[name] = runs[name]()
            if rep:
                secs[name].append(time.perf_counter() - t0)
    return secs, out


def report(secs: dict[str, list[float]]) -> None:
    for name, values in secs.items():
        print(f"  {name:8s} median {statistics.median(values):.3f} s  (min {min(values):.3f}, max {max(values):.3f})")
    ratios = [p / b for p, b in zip(secs["product"], secs["baseline"], strict=True)]
    print(f"  product / baseline: median of per-repetition ratios {statistics.median(ratios):.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flavour", default="paper-150m")
    parser.add_argument("--paths", type=int, default=2, help="contributions folded into the module")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--weighting", choices=["uniform", "tokens"], default="uniform")
    parser.add_argument("--blob-dir", type=Path, default=None)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    params = init_state(flavour(args.flavour), seed=0)
    momentum = {n: torch.randn(t.shape, generator=gen) * 1e-3 for n, t in params.items()}
    grads = [{n: torch.randn(t.shape, generator=gen) * 1e-2 for n, t in params.items()} for _ in range(args.paths)]
    weights = [1.0] * args.paths if args.weighting == "uniform" else [float(1000 + 17 * i) for i in range(args.paths)]
    cfg = OuterConfig()
    size = sum(t.numel() for t in params.values())
    print(
        f"{args.flavour}: one module of {size:,} parameters in {len(params)} tensors, {args.paths} contributions, "
        f"{args.weighting} weights, torch threads {torch.get_num_threads()}"
    )
    print("[arithmetic] fold, finish, weight norm")
    secs, out = alternate(
        {
            "baseline": lambda: baseline(params, momentum, grads, weights, cfg),
            "product": lambda: product(params, momentum, grads, weights, cfg),
        },
        args.reps,
    )
    (bw, bm, bn), (pw, pm, pn) = out["baseline"], out["product"]  # type: ignore[misc]
    same = all(torch.equal(bw[n], pw[n]) and torch.equal(bm[n], pm[n]) for n in params)
    print(f"  weights and momentum bit for bit equal: {same}; norms {bn:.12g} vs {pn:.12g} ({abs(bn - pn) / bn:.1e})")
    report(secs)
    if not same or abs(bn - pn) > 1e-12 * bn:
        raise SystemExit("the product's outer step differs from the baseline's")

    print("[store] the new weights and momentum, hashed, written and fsynced")
    with tempfile.TemporaryDirectory(prefix="bench-outer-step-", dir=args.blob_dir) as d:
        store = LocalBlobStore(Path(d))

        def drop(*digests: str) -> tuple[str, ...]:  # each put writes anew: nothing is already there
            for digest in digests:
                os.unlink(store.path(digest))
            return digests

        secs, out = alternate(
            {
                "baseline": lambda: drop(store.put_bytes(encode(pw)), store.put_bytes(encode(pm))),
                "product": lambda: drop(store.put_tensors(pw), store.put_tensors(pm)),
            },
            args.reps,
        )
        print(f"  the same blob names: {out['baseline'] == out['product']}")
        report(secs)


if __name__ == "__main__":
    main()
