"""Island benchmarks, all ratios measured in the same run.

1. Inner-loop throughput: `Island._inner_steps` (the code an island runs per lease: stop / lease-lost checks,
   progress bar, `island.inner.inner_phase`) vs a bare PyTorch loop (zero_grad → forward → backward → clip →
   AdamW step, lr schedule, no per-step sync) on the same model, weights and batches; interleaved repetitions,
   median of the per-repetition ratios. Target >= 0.97.
2. Round wall-clock on loopback: a real coordinator (subprocess, SQLite) and one in-process island train a
   1-path run of the given flavour; per round: fetch (weights + tokens + compose), train, upload, and the rest
   (lease requests, waits); the share of the wall-clock spent outside training.
3. Bytes per round: what the island moved (downloads on cache misses + the outer-gradient upload) vs what DDP
   would move for the same H steps. DDP is counted as 2 x params x 4 bytes per step per worker (ring all-reduce
   of fp32 gradients sends and receives ~(N-1)/N of the buffer twice; the bound 2x is used), times H.

    .venv/bin/python bench/bench_island.py [--flavour small] [--steps 20] [--reps 7] [--rounds 4] [--threads N]
                                           [--device cpu|cuda]

On CUDA both loops run the forward under the island's bf16 autocast (`island.inner.device_autocast`) and the bare
loop synchronises the device once at the end, as the island does.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import httpx
import numpy as np
import torch
from rich.console import Console

from coordinator.client import CoordinatorClient, CoordinatorUnavailable
from coordinator.schemas import LeaseModule, LeasePublic, LeaseShard
from coordinator.states import LeaseStatus
from island.distributed import free_port
from island.heartbeat import Heartbeater
from island.inner import device_autocast
from island.worker import Island, IslandConfig, LeaseResult
from modules import InnerConfig, ModelConfig, PathModel, batches_from_tokens, build_path, flavour, init_state


def bare_loop(
    model: PathModel,
    optimizer: torch.optim.Optimizer,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    cfg: InnerConfig,
    device: torch.device,
) -> None:
    model.train()
    params = list(model.parameters())
    autocast = device_autocast(device)
    for i, (x, y) in enumerate(batches):
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        for group in optimizer.param_groups:
            group["lr"] = cfg.lr_at(i)
        optimizer.zero_grad(set_to_none=True)
        with autocast():
            loss = model.loss(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        optimizer.step()
    float(loss.detach())  # one sync at the end, as the island does


def fake_lease(cfg: ModelConfig, inner: InnerConfig, steps: int) -> LeasePublic:
    return LeasePublic(
        lease_id=1,
        run_id=1,
        round=0,
        path_id=1,
        path_index=0,
        model=cfg.to_dict(),
        inner={k: getattr(inner, k) for k in InnerConfig.__dataclass_fields__},
        inner_steps=steps,
        first_step=0,
        modules=[LeaseModule(level=0, level_name="all", module_id=1, version=0, weights_hash="0" * 64)],
        shard=LeaseShard(shard_id=1, tokens_hash="0" * 64, num_tokens=0),
        token_start=0,
        token_end=1,
        epoch=0,
        seed=0,
        expires_at=datetime(2030, 1, 1, tzinfo=UTC),
        status=LeaseStatus.ACTIVE,
    )


def bench_inner(cfg: ModelConfig, *, steps: int, reps: int, batch_size: int, device: str) -> dict[str, float]:
    inner = InnerConfig(warmup_steps=2, total_steps=steps, batch_size=batch_size)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (steps * batch_size * cfg.seq_len + 1,), generator=gen)
    batches = batches_from_tokens(tokens, batch_size=batch_size, seq_len=cfg.seq_len, steps=steps)
    weights = init_state(cfg, seed=0)
    tmp = tempfile.mkdtemp(prefix="bench-island-")
    islands = {}
    for which, quiet in (("island", True), ("island+bar", False)):
        island = Island(
            IslandConfig(coordinator="http://127.0.0.1:9", token="x", cache_dir=Path(tmp), device=device, quiet=quiet),
            console=Console(file=io.StringIO(), width=120, force_terminal=True),
        )
        island.device = torch.device(device)  # join() resolves it; these islands never join
        island._heartbeat = Heartbeater(island.client, interval_s=3600)  # never started: the flag checks still run
        islands[which] = island
    lease = fake_lease(cfg, inner, steps)
    tokens_per_rep = steps * batch_size * cfg.seq_len
    order = ["bare", *islands]
    secs: dict[str, list[float]] = {k: [] for k in order}
    for rep in range(reps + 1):  # rep 0 warms everything up
        for which in order[rep % 3 :] + order[: rep % 3]:  # rotate who goes first
            model = build_path(cfg, [weights]).to(device)
            optimizer = torch.optim.AdamW(model.parameters(), lr=inner.lr, betas=(inner.beta1, inner.beta2))
            t0 = time.perf_counter()
            if which == "bare":
                bare_loop(model, optimizer, batches, inner, torch.device(device))
            else:
                result = LeaseResult(lease_id=1, round=0, path_index=0, status="uploaded")
                islands[which]._inner_steps(lease, model, optimizer, batches, inner, result)
            if rep:
                secs[which].append(time.perf_counter() - t0)
    for island in islands.values():
        island.client.close()
    out = {f"{k}_tok_s": tokens_per_rep / statistics.median(v) for k, v in secs.items()}
    for k in islands:
        out[f"{k}_ratio_median"] = statistics.median(b / i for b, i in zip(secs["bare"], secs[k], strict=True))
        out[f"{k}_ratio_best"] = min(secs["bare"]) / min(secs[k])
    return out


@contextlib.contextmanager
def coordinator(tmp: Path, admin: str, join: str) -> Iterator[str]:
    port = free_port()
    env = {**os.environ, "DIPACO_ADMIN_TOKEN": admin, "DIPACO_JOIN_TOKEN": join}
    log = (tmp / "coordinator.log").open("ab")
    proc = subprocess.Popen(
        [sys.executable, "-m", "dipaco", "coordinator", "serve", "--port", str(port), "--data-dir", str(tmp / "c"),
         "--log-level", "warning"],
        stdout=log, stderr=subprocess.STDOUT, env=env,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        with CoordinatorClient(url, admin, timeout=httpx.Timeout(2.0)) as probe:
            while True:
                with contextlib.suppress(CoordinatorUnavailable):
                    probe.health(give_up_after_s=0)
                    break
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError(f"coordinator did not start; see {tmp / 'coordinator.log'}")
                time.sleep(0.2)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def bench_round(
    flavour_name: str, *, steps: int, rounds: int, batch_size: int, device: str
) -> tuple[list[LeaseResult], float, int]:
    cfg = flavour(flavour_name)
    admin, join = secrets.token_hex(16), secrets.token_hex(16)
    with tempfile.TemporaryDirectory(prefix="bench-island-") as d, coordinator(Path(d), admin, join) as url:
        spec = {
            "name": "bench",
            "model": {"flavour": flavour_name},
            "layout": f"embed:shared, b0-{cfg.n_layers - 1}:shared, head:shared",
            "inner": {"batch_size": batch_size, "warmup_steps": 2},
            "inner_steps": steps,
            "num_rounds": rounds,
        }
        with CoordinatorClient(url, admin) as client:
            run = client.create_run(spec)
            need = rounds * steps * batch_size * cfg.seq_len + 1
            body = np.random.default_rng(0).integers(0, 256, need).astype("<u2").tobytes()
            client.register_shard(run.id, 0, body, num_documents=1)
            params = sum(m.num_params for m in client.modules(run_id=run.id))
        island = Island(
            IslandConfig(
                coordinator=url, token=join, cache_dir=Path(d) / "island", device=device, quiet=True,
                handle_signals=False, probe=False,
            )
        )  # fmt: skip
        t0 = time.perf_counter()
        code = island.run()
        wall = time.perf_counter() - t0
        if code:
            raise RuntimeError(f"island exited with {code}")
        return island.results, wall, params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flavour", default="small")
    parser.add_argument("--steps", type=int, default=20, help="H, inner steps per round")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (the island's --device)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = flavour(args.flavour)
    print(
        f"flavour {args.flavour}, H={args.steps}, batch {args.batch_size}x{cfg.seq_len}, "
        f"threads {torch.get_num_threads()}, device {args.device}"
        + (f" ({torch.cuda.get_device_name(torch.device(args.device))})" if args.device.startswith("cuda") else "")
    )

    r = bench_inner(cfg, steps=args.steps, reps=args.reps, batch_size=args.batch_size, device=args.device)
    print(f"[inner] bare loop {r['bare_tok_s']:.0f} tok/s (median over repetitions)")
    for k in ("island", "island+bar"):
        print(
            f"[inner] {k:10s} {r[f'{k}_tok_s']:.0f} tok/s, ratio to bare: median of per-repetition ratios "
            f"{r[f'{k}_ratio_median']:.3f}, best-of {r[f'{k}_ratio_best']:.3f} (target >= 0.97)"
        )

    results, wall, params = bench_round(
        args.flavour, steps=args.steps, rounds=args.rounds, batch_size=args.batch_size, device=args.device
    )
    print(f"[round] {len(results)} rounds on loopback, {wall:.2f} s from start to leave, {params} params on the path")
    print("  round  fetch_s  train_s  upload_s  other_s  outside%  down_MB  up_MB")
    total_train = sum(x.train_s for x in results)
    per_round_other = (wall - sum(x.fetch_s + x.train_s + x.upload_s for x in results)) / len(results)
    for x in results:
        round_wall = x.fetch_s + x.train_s + x.upload_s + per_round_other
        print(
            f"  {x.round:5d}  {x.fetch_s:7.3f}  {x.train_s:7.3f}  {x.upload_s:8.3f}  {per_round_other:7.3f}  "
            f"{100 * (1 - x.train_s / round_wall):7.1f}%  {x.download_bytes / 1e6:7.2f}  {x.upload_bytes / 1e6:5.2f}"
        )
    steady = results[1:] or results
    steady_wall = sum(x.fetch_s + x.train_s + x.upload_s + per_round_other for x in steady)
    print(
        f"  outside training: {100 * (1 - total_train / wall):.1f}% of all wall-clock (incl. join, cold cache), "
        f"{100 * (1 - sum(x.train_s for x in steady) / steady_wall):.1f}% in rounds >= 1 "
        "(other_s = wall-clock not in fetch/train/upload, spread evenly: lease requests, join, leave)"
    )

    island_bytes = statistics.median(x.download_bytes + x.upload_bytes for x in steady)
    ddp_bytes = 2 * params * 4 * args.steps
    print(
        f"[bytes] island per round (steady state: weights down + outer gradient up) {island_bytes / 1e6:.2f} MB; "
        f"DDP for the same {args.steps} steps 2 x {params} x 4 B x {args.steps} = {ddp_bytes / 1e6:.2f} MB; "
        f"DDP/island = {ddp_bytes / island_bytes:.1f}x"
    )


if __name__ == "__main__":
    main()
