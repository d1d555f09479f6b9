"""Where an overlap lease moves onto its versions, with the timing taken out: replay one overlap run of
bench/bench_async.py with the reference (`modules.asynchrony.simulate_async`), in the arrival order its registry
recorded, once with each lease's move at the step its island reported and once with every move before step 0
(what a lease that waited for its versions does), and score both like the bench (routed held-out perplexity).
Both replays see the same leases, tokens, versions and staleness; only the moves differ.

    python bench/replay_overlap.py /tmp/bench-async-work/run-<stamp>/overlap/data [--workdir /tmp/bench-async-work]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import sqlite3
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dipaco.evaluation import load_documents  # noqa: E402
from dipaco.quality import HALVES, split_heldout  # noqa: E402
from modules import InnerConfig, ModelConfig, OuterConfig, build_path, parse_layout  # noqa: E402
from modules.asynchrony import AsyncSettings, Lease, Tensors, Upload, simulate_async  # noqa: E402
from router.evaluate import evaluate_routed  # noqa: E402
from router.router import Router  # noqa: E402
from router.shards import ROUTER_DIR  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("data", type=Path, help="the overlap mode's data directory (dipaco.db, blobs/)")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/bench-async-work"), help="bench_async's corpus")
    ap.add_argument("--docs-per-domain", type=int, default=200)
    ap.add_argument("--eval-docs", type=int, default=200)
    args = ap.parse_args()
    db = sqlite3.connect(args.data / "dipaco.db")
    layout_s, config_s, run_inner = db.execute("SELECT layout, config, inner_steps FROM runs").fetchone()
    config = json.loads(config_s)
    cfg = ModelConfig.from_dict(config["model"])
    layout = parse_layout(layout_s, n_layers=cfg.n_layers)
    schedule = config["schedule"]

    def blob(sha: str) -> bytes:
        return (args.data / "blobs" / sha[:2] / sha).read_bytes()

    tokens = [
        torch.from_numpy(np.frombuffer(blob(sha), dtype="<u2").astype(np.int64))
        for (sha,) in db.execute("SELECT tokens_hash FROM shards ORDER BY path_index")
    ]
    path_index = dict(db.execute('SELECT id, "index" FROM paths'))
    level_of = dict(db.execute("SELECT id, level_index FROM modules"))
    leases = {r[0]: r[1:] for r in db.execute("SELECT id, island_id, inner_steps, token_start, first_step FROM leases")}
    events: list[Lease | Upload] = []
    steps_done = [0] * layout.num_paths
    accepted = "SELECT id, lease_id, path_id FROM contributions WHERE status = 'accepted' ORDER BY id"
    for cid, lease_id, path_id in db.execute(accepted).fetchall():
        parts = db.execute(
            "SELECT module_id, base_version, rebased_at FROM contribution_grads WHERE contribution_id = ?", (cid,)
        ).fetchall()
        versions = {level_of[m]: v for m, v, _ in parts}
        moved = {level_of[m]: at for m, _, at in parts if at is not None}
        island, h, start, first_step = leases[lease_id]
        path = path_index[path_id]
        steps = h or run_inner
        steps_done[path] += steps
        events += [
            Lease(
                path, steps, island=island, versions=tuple(versions[lv] for lv in range(len(versions))),
                start=start, first_step=first_step, key=lease_id, through=tuple(sorted(moved)),
                rebase_at=next(iter(moved.values()), None),
            ),
            Upload(path, key=lease_id),
        ]  # fmt: skip
    settings = AsyncSettings(
        sync="async",
        max_staleness=schedule["max_staleness"],
        damping=schedule["staleness_damping"],
        dn_period=schedule["dn_period"],
    )
    at = collections.Counter(e.rebase_at for e in events if isinstance(e, Lease) and e.rebase_at is not None)
    print(f"{len(events) // 2} uploads; moved before step: {dict(sorted(at.items()))}", flush=True)
    corpus = args.workdir / f"corpus-{args.docs_per_domain}"
    halves = split_heldout(load_documents(corpus, "heldout"), max_docs=args.eval_docs)
    documents = [d for h in HALVES for d in halves[h]]
    router = Router.load(args.workdir / f"shards-{args.docs_per_domain}" / f"shards-{layout.num_paths}" / ROUTER_DIR)
    for name, replayed in (
        ("as recorded", events),
        ("every move before step 0", [
            dataclasses.replace(e, rebase_at=0) if isinstance(e, Lease) and e.rebase_at is not None else e
            for e in events
        ]),
    ):  # fmt: skip
        t0 = time.perf_counter()
        ref = simulate_async(
            cfg,
            layout,
            InnerConfig(**config["inner"]),
            OuterConfig(**config["outer"]),
            settings,
            events=replayed,
            budget_steps=min(steps_done),
            seed=0,
            tokens=tokens,
            codec=config["codec"],
            sparse_rows=config["sparse_rows"],
        )

        def build(p: int, modules: list[list[Tensors]] = ref.modules) -> torch.nn.Module:
            return build_path(cfg, [modules[lv][m] for lv, m in enumerate(layout.path_modules(p))])

        scored = evaluate_routed(build, router, documents, prefix_tokens=router.prefix_tokens, context=cfg.seq_len)
        quarter = [u.loss for u in ref.uploads][-(len(ref.uploads) // 4) :]
        per_path = " ".join(f"{p.perplexity:.2f}" if p.perplexity is not None else "-" for p in scored.per_path)
        print(
            f"{name}: routed held-out ppl {scored.perplexity:.3f} (per path {per_path}), mean train loss of the last "
            f"quarter of uploads {sum(quarter) / len(quarter):.4f} ({time.perf_counter() - t0:.0f} s)",
            flush=True,
        )


if __name__ == "__main__":
    main()
