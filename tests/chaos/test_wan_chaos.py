"""Chaos over an emulated WAN: four islands, each in its own network namespace behind a link with 80 ms RTT, 1 %
loss and 50 Mbit/s each way (tests/chaos/netns.py), train a 2x2 run against a real coordinator process while
islands are SIGKILLed at seeded random moments (a replacement starts on the same host) and the coordinator is
SIGKILLed once in the middle of an upload and restarted on the same database (tests/chaos/driver.py).

Asserted: the faults fired (exit -9 each, the WAN delayed and dropped packets) and healed; the run finishes with
exactly paths x rounds contributions; every module version recomputes from the stored contributions and no round
was applied twice (`verify_run`); every contribution replays in-process from its base versions and token range
with the inner AdamW state and codec residual its island really had (tests/chaos/replay.py): same loss, same
outer gradient, each path's data cursor one lease per round. The run uses the default codec (int8 with error
feedback when this was written).

Calm vs chaos: the calm run is the reference simulator on the same spec, seeds and shards (a calm service run
equals it: tests/integration/test_service_matches_simulator.py; here rounds before the first kill match it to
the last bit). A chaos run differs from it only where an island died holding a path's inner AdamW state
(`dipaco island join` keeps that state in its process memory): the path restarts from a fresh AdamW, whose
first steps are larger. A kill costs one to three such restarts, in its round and the next two (the dead
island's path may first go to a live island, whose own path then goes to the replacement). Their effect on the
final train loss depends on when they happen, which is why the spec has 8 rounds and the kills come in rounds
1-2. Measured with the simulator (restarts injected; this spec and shards): every placement of up to 3 restarts
in rounds 1-3 (298) ends within -0.6 % .. +1.8 % of the calm final loss with the int8 codec (fp32: +1.2 %), and
random sets of 2-5 restarts in rounds 1-4 within -0.6 % .. +1.6 % (200 int8, 400 fp32); the runs here see 2-4.
So the issue's 2 % holds for every timing enumerated, but the margin is empirical and specific to this spec: the
final train loss of a run this small is noisy (the calm run's own loss rises over its last two rounds); in a
6-round run two restarts in rounds 1-3 ranged from -1.9 % to +4.9 % (fp32, 2 of 60 placements over 2 %), and in
a 10-round run 2 of 100 random sets of 2-5 restarts in rounds 1-4 gave +2.5 % and +7.3 % (int8). The bound is
a property of where the restarts fall, not of the network or of the coordinator kill, which change nothing (the
replay shows it); if it fails, the printed restarts and the replay say whether the service or the optimizer
restarts are to blame.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from modules import InnerConfig, ModelConfig, OuterConfig, parse_layout, simulate
from tests.chaos.driver import ChaosRun, Schedule
from tests.chaos.netns import EmulatedWan, Impairment, tcp_rtt_ms, unavailable_reason
from tests.chaos.replay import replay_run
from tests.integration.checks import verify_run
from tests.integration.conftest import Cluster

pytestmark = pytest.mark.integration

SEED = 14
ROUNDS = 8
SPEC: dict[str, Any] = {
    "name": "wan-chaos",
    "model": {"flavour": "debug", "d_model": 32, "seq_len": 16, "n_heads": 2},
    "layout": "embed:shared, b0-0:routed2, b1-1:routed2, head:shared",
    "inner": {"batch_size": 2, "warmup_steps": 0, "lr": 0.01},
    "inner_steps": 8,
    "num_rounds": ROUNDS,
    "lease_ttl_s": 8,
    "seed": 3,
}
PATHS = 4
SCHEDULE = Schedule.seeded(SEED, kill_rounds=range(1, 3), paths=PATHS, island_kills=2, max_after_s=1.5)
IMPAIRMENT = Impairment(delay_ms=40, loss=0.01, rate_mbit=50)
LOSS_BOUND = 0.02
"""The issue's bound on |chaos - calm| / calm of the final round's mean train loss (see the module docstring)."""


@pytest.fixture
def wan(tmp_path: Path) -> Iterator[EmulatedWan]:
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"cannot emulate a WAN here: {reason}")
    with EmulatedWan(PATHS, workdir=tmp_path / "wan", impairment=IMPAIRMENT, seed=SEED) as emulated:
        yield emulated


def calm_losses(run: dict[str, Any], tokens: list[torch.Tensor], *, seed: int) -> list[list[float]]:
    """Per-round, per-path train losses of the same run without faults (the reference simulator)."""
    cfg = ModelConfig.from_dict(run["config"]["model"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the islands run (see tests/chaos/replay.py)
    try:
        return simulate(
            cfg,
            parse_layout(run["layout"], n_layers=cfg.n_layers),
            InnerConfig(**run["config"]["inner"]),
            OuterConfig(**run["config"]["outer"]),
            steps_per_round=run["inner_steps"],
            rounds=run["num_rounds"],
            seed=seed,
            tokens=tokens,
            codec=run["config"].get("codec", "fp32"),
        ).losses
    finally:
        torch.set_num_threads(threads)


def test_run_survives_island_and_coordinator_kills_over_a_lossy_wan(tmp_path: Path, wan: EmulatedWan) -> None:
    cluster = Cluster(tmp=tmp_path, database_url=f"sqlite:///{tmp_path / 'registry.db'}", host=wan.server_address)
    try:
        outcome = ChaosRun(cluster, hosts=wan.hosts, schedule=SCHEDULE, timeout_s=150).run(SPEC, num_tokens=2000)
        rtt_ms = tcp_rtt_ms(wan.hosts[0], wan.server_address, cluster.port)
        with cluster.admin() as client:
            run = client.get(f"/v1/runs/{outcome.run_id}").json()
            contributions = client.get("/v1/contributions", params={"run_id": outcome.run_id}).json()
            paths = client.get("/v1/paths", params={"run_id": outcome.run_id}).json()["data"]
            tokens = [
                torch.from_numpy(
                    np.frombuffer(client.get(f"/v1/shards/{p['shard_id']}/tokens").content, "<u2").astype(np.int64)
                )
                for p in sorted(paths, key=lambda p: p["index"])
            ]
    finally:
        cluster.stop()
    link = wan.stats()

    # the faults fired, and healed
    kinds = [f.kind for f in outcome.faults]
    assert kinds.count("coordinator") == 1 and kinds.count("island") == len(SCHEDULE.island_kills), outcome.faults
    assert all(f.recovery_s is not None for f in outcome.faults), outcome.faults
    killed = {f.island for f in outcome.faults if f.kind == "island"}
    assert {n: c for n, c in outcome.exit_codes.items() if n in killed} == dict.fromkeys(killed, -9)
    assert {n: c for n, c in outcome.exit_codes.items() if n not in killed} == {
        n: 0 for n in outcome.exit_codes if n not in killed
    }, [cluster.log(n) for n in outcome.exit_codes]
    assert rtt_ms >= 2 * IMPAIRMENT.delay_ms * 0.95, rtt_ms
    assert link.packets > 0 and link.lost > 0, link

    # the run finished, every round once, every module version recomputed from the stored contributions
    assert run["status"] == "finished" and contributions["count"] == PATHS * ROUNDS
    verify_run(cluster.database_url, cluster.data_dir / "blobs", outcome.run_id)

    # every contribution is what its island should have computed, with the AdamW state it really had
    replay = replay_run(cluster.database_url, cluster.data_dir / "blobs", outcome.run_id)
    assert replay.max_loss_diff <= 1e-6 and replay.max_grad_diff <= 1e-6, replay  # bit-identical here
    assert replay.restarts, "an island died holding a path's AdamW state, yet no lease restarted from a fresh one"

    calm = calm_losses(run, tokens, seed=SPEC["seed"])
    calm_final, chaos_final = sum(calm[-1]) / PATHS, replay.final_loss
    diff = (chaos_final - calm_final) / calm_final
    print(  # noqa: T201  (the numbers docs/LOG.md records; shown with -s)
        f"\nWAN {IMPAIRMENT} ({wan.backend}; measured RTT {rtt_ms:.0f} ms, {link.lost}/{link.packets} packets "
        f"lost); faults: {SCHEDULE}\n"
        + "\n".join(
            f"  {f.kind} {f.island or ''} round {f.round} {f.state}: healed in {f.recovery_s:.1f} s"
            for f in outcome.faults
        )
        + f"\n  AdamW restarts: {[(r.round, r.path) for r in replay.restarts]}"
        + f"\n  final train loss: calm {calm_final:.4f}, chaos {chaos_final:.4f} ({diff:+.2%}); {outcome.wall_s:.0f} s"
    )
    assert abs(diff) <= LOSS_BOUND, (calm_final, chaos_final, replay.restarts)
