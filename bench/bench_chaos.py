"""Chaos bench: the same run twice, calm and under chaos, and what the chaos cost.

* calm: a real coordinator (SQLite) and one `dipaco island join` process per path on loopback, no faults;
* chaos: the islands on emulated WAN hosts (tests/chaos/netns.py: a network namespace each, 80 ms RTT, 1 % loss,
  50 Mbit/s by default), a seeded schedule of island SIGKILLs (a replacement starts on the same host at once) and
  one coordinator SIGKILL paused inside the first upload, then its restart (tests/chaos/driver.py).

Prints, per run: wall time and the final round's mean train loss; for the chaos run the faults with their
recovery times (coordinator kill -> next applied round; island kill -> its path leased to another island), the
inner AdamW restarts the kills caused and the replay's check that each contribution is exactly what its island
should have computed with the state it had (tests/chaos/replay.py), and `verify_run` on both runs. Needs root
(namespaces); results go to docs/LOG.md.

    .venv/bin/python bench/bench_chaos.py [--rounds 12] [--inner-steps 8]
        [--layout "embed:shared, b0-0:routed2, b1-1:routed3, head:shared"]
        [--kills 4] [--kill-rounds 1-6] [--max-after 1.5] [--seed 14] [--no-coordinator-kill]
        [--delay-ms 40] [--loss 0.01] [--rate-mbit 50] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `tests.*` is not an installed package

from modules import parse_layout  # noqa: E402
from tests.chaos.driver import ChaosRun, Outcome, Schedule  # noqa: E402
from tests.chaos.netns import EmulatedWan, Impairment, tcp_rtt_ms, unavailable_reason  # noqa: E402
from tests.chaos.replay import Replay, replay_run  # noqa: E402
from tests.integration.checks import verify_run  # noqa: E402
from tests.integration.conftest import Cluster  # noqa: E402


def spec(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "name": "bench-chaos",
        "model": {"flavour": "debug", "d_model": 32, "seq_len": 16, "n_heads": 2},
        "layout": args.layout,
        "inner": {"batch_size": 2, "warmup_steps": 0, "lr": 0.01},
        "inner_steps": args.inner_steps,
        "num_rounds": args.rounds,
        "lease_ttl_s": 8,
        "seed": 3,
    }


def num_tokens(args: argparse.Namespace) -> int:
    return max(2000, args.rounds * args.inner_steps * 2 * 16 + 1)  # one epoch covers the run


def finished(cluster: Cluster, outcome: Outcome) -> Replay:
    """Check the run's invariants (`verify_run`) and replay it; returns the replay (losses, restarts)."""
    verify_run(cluster.database_url, cluster.data_dir / "blobs", outcome.run_id)
    return replay_run(cluster.database_url, cluster.data_dir / "blobs", outcome.run_id)


def one_run(
    workdir: Path, args: argparse.Namespace, *, wan: EmulatedWan | None, schedule: Schedule
) -> tuple[Outcome, Replay, float | None]:
    host = wan.server_address if wan is not None else "127.0.0.1"
    workdir.mkdir(parents=True, exist_ok=True)
    cluster = Cluster(tmp=workdir, database_url=f"sqlite:///{workdir / 'registry.db'}", host=host)
    rtt_ms = None
    try:
        chaos = ChaosRun(cluster, hosts=wan.hosts if wan else None, schedule=schedule, timeout_s=args.timeout)
        outcome = chaos.run(spec(args), num_tokens=num_tokens(args))
        if wan is not None:
            rtt_ms = tcp_rtt_ms(wan.hosts[0], wan.server_address, cluster.port)
    finally:
        cluster.stop()
    return outcome, finished(cluster, outcome), rtt_ms


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--layout", default="embed:shared, b0-0:routed2, b1-1:routed3, head:shared")
    parser.add_argument("--inner-steps", type=int, default=8)
    parser.add_argument("--kills", type=int, default=4, help="island SIGKILLs, in distinct rounds")
    parser.add_argument("--kill-rounds", default="1-6", help="rounds A-B (inclusive) the kills are drawn from")
    parser.add_argument(
        "--max-after", type=float, default=1.5, help="a kill fires up to this long after its round opened"
    )
    parser.add_argument("--seed", type=int, default=14, help="seeds the fault schedule and the link's loss draws")
    parser.add_argument("--no-coordinator-kill", action="store_true")
    parser.add_argument("--delay-ms", type=float, default=40.0, help="one way, each direction")
    parser.add_argument("--loss", type=float, default=0.01)
    parser.add_argument("--rate-mbit", type=float, default=50.0)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    reason = unavailable_reason()
    if reason is not None:
        print(f"cannot emulate a WAN here: {reason}")
        return 2
    first, last = (int(x) for x in args.kill_rounds.split("-"))
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench-chaos-"))
    impairment = Impairment(delay_ms=args.delay_ms, loss=args.loss, rate_mbit=args.rate_mbit)
    paths = parse_layout(args.layout, n_layers=2).num_paths
    schedule = Schedule.seeded(
        args.seed,
        kill_rounds=range(first, last + 1),
        paths=paths,
        island_kills=args.kills,
        max_after_s=args.max_after,
        coordinator_kill=not args.no_coordinator_kill,
    )
    print(f"spec: {args.layout} ({paths} paths, {paths} islands), {args.rounds} rounds x {args.inner_steps} steps")
    print(f"schedule (seed {args.seed}): {schedule}")
    print(f"workdir: {workdir}")

    t0 = time.monotonic()
    calm, calm_replay, _ = one_run(workdir / "calm", args, wan=None, schedule=Schedule())
    print(
        f"calm:  {calm.wall_s:.0f} s, final train loss {calm_replay.final_loss:.4f} (loopback, no faults; "
        f"codec {calm_replay.codec})"
    )
    with EmulatedWan(paths, workdir=workdir / "wan", impairment=impairment, seed=args.seed) as wan:
        chaos, chaos_replay, rtt_ms = one_run(workdir / "chaos", args, wan=wan, schedule=schedule)
        link = wan.stats()
        backend = wan.backend
    diff = (chaos_replay.final_loss - calm_replay.final_loss) / calm_replay.final_loss
    print(
        f"chaos: {chaos.wall_s:.0f} s, final train loss {chaos_replay.final_loss:.4f} ({diff:+.2%} vs calm); "
        f"WAN {impairment} via {backend}, measured RTT {rtt_ms:.0f} ms, {link.lost}/{link.packets} packets lost"
    )
    for f in chaos.faults:
        who = f"{f.island} (path {f.path})" if f.kind == "island" else "coordinator"
        healed = f"{f.recovery_s:.1f} s" if f.recovery_s is not None else "never"
        print(f"  {f.kind:11s} {who:22s} round {f.round:2d}, {f.state:32s} healed in {healed}")
    print(f"  AdamW restarts (round, path): {[(r.round, r.path) for r in chaos_replay.restarts]}")
    print(
        f"  replay: max |loss diff| {chaos_replay.max_loss_diff:.1e}, max |outer-gradient diff| "
        f"{chaos_replay.max_grad_diff:.1e} (calm run: {calm_replay.max_loss_diff:.1e}, "
        f"{calm_replay.max_grad_diff:.1e}; restarts {len(calm_replay.restarts)})"
    )
    per_round = "  ".join(
        f"{r}:{sum(c) / len(c):.3f}/{sum(x) / len(x):.3f}"
        for r, (c, x) in enumerate(zip(calm_replay.losses, chaos_replay.losses, strict=True))
    )
    print(f"  mean train loss per round, calm/chaos: {per_round}")
    print(f"total {time.monotonic() - t0:.0f} s; verify_run passed on both runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
