"""Async / hybrid bench: the same 2x2 debug model trained for the same wall budget up to four ways, by 4
islands of which one is ~3x slower, slowed from outside its process by a duty-cycled SIGSTOP/SIGCONT (stopped
2/3 of every 30 ms by default, `--duty-period-s`):

* round: `sync=round`, every module steps when all 4 paths uploaded the round;
* async: `sync=async`, staleness-damped Delayed Nesterov, dynamic local updates (H scaled by island speed
  within `min_inner_steps..max_inner_steps`), `overlap` off: an island whose upload made its path's module
  steps due waits for them;
* overlap: async with `overlap` on (the run default): that island's upload reply brings its next lease at once;
  it waits before its first step for the new versions (up to the island's `overlap_wait`, 0.1 of the lease) and
  trains on through the steps from its own end weights only if they have not landed by then;
* hybrid: embedding and head `:async` in the layout, the routed blocks by round.

Each mode gets a fresh coordinator (`LocalService`: SQLite + blob dir) and 4 `dipaco island join` processes, on
the same corpus and shards (dipaco.quality: the built-in local corpus, flat k-means into 4 paths, byte tokens).
The islands run at nice 10 (`--island-nice`): the coordinator stands for a host of its own.
The slow island is throttled from its start (its join probe sees a slow machine), and every island is stopped
while the shards are registered so that all ask for their first lease at once (see `train`). On 2 shared cores
the slow island's leases take ~1.8x as long as the others', not 3x (it has a core to itself while it runs, the
others share): the table shows the measured lease seconds; `--slow-factor` stops it longer.

While a run trains the bench polls `GET /v1/modules` every 0.5 s and records when each module version appeared
(its `updated_at`); afterwards it scores the routed held-out perplexity of the versions that were current at
chosen wall times, fetched over REST (`GET /v1/modules/{id}/weights?version=v`). A version replaced within one
poll is never scored: a state at time t is the newest *seen* version of each module (slightly pessimistic).

1. Per mode: tokens trained and contributions accepted / refused (409 stale) within the budget, held-out
   perplexity at `points` times of it. `reach`: the time async / hybrid take to reach round's final perplexity
   (first point at or below it, then bisected `refine` times), over the time round's final state appeared
   (target <= 0.7x). `@tokens`: perplexity once a mode had as many tokens accepted as round in its whole budget,
   over round's final (target within 3 %).
2. Island idle share from the first lease to the end of the budget: time an island held no lease (nothing in
   the island or /metrics reports it), from the lease records over REST: a lease is busy from `issued_at` to its
   accepted upload, its refusal event or its expiry; less the time an overlap lease waited for its versions,
   before its first step or after its last (from the islands' log lines). Target <= 2 % async.
3. After the budget, a fast island is SIGSTOPped as soon as it holds a lease, for `stall_leases` of its lease
   lengths in the round run (the same seconds for every mode): contributions the other islands got accepted
   during the stall.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_async.py [--quick] [--budget-s 180] [--inner-steps 30]
        [--min-inner-steps 10] [--max-inner-steps 60] [--batch-size 16] [--points 6] [--eval-docs 200] [--seed 0]
        [--slow-factor 3] [--duty-period-s 0.03] [--island-nice 10] [--parts 1,2,3] [--modes round,async,overlap,hybrid]
        [--damping inverse|inverse_square|none]
        [--max-staleness S] [--path-leases N] [--async-outer-lr LR] [--async-outer-momentum M]
        [--out /tmp/bench-async.json] [--workdir /tmp/bench-async-work]

The defaults take ~20-25 minutes on 2 cores, `--quick` (20 s per mode, H 10) ~3.5 minutes: a smoke test whose
numbers are dominated by per-lease overheads.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from bench_coordinator import drop_pg, pg_database

from coordinator.schemas import ContributionSummary, EventPublic, LeaseSummary, ModulePublic, OuterSpec, RunCreate
from coordinator.services.runs import DEFAULT_ASYNC_LR_FACTOR, DEFAULT_ASYNC_MOMENTUM
from coordinator.states import EventKind, LeaseStatus
from dipaco.evaluation import fetch_run_paths, load_documents
from dipaco.quality import HALVES, QualitySettings, VersionedWeights, prepare_corpus, shards_for, split_heldout
from dipaco.quality import standard_contenders as contenders
from dipaco.router_commands import register_shards
from dipaco.service import STOP_TIMEOUT_S, LocalService, ServiceError, tail
from island.worker import OVERLAP_WAIT
from modules import build_path
from router.evaluate import EvalResult, evaluate_routed
from router.router import Router
from router.shards import ROUTER_DIR

MODES = ("round", "async", "overlap", "hybrid")
ISLANDS = 4
DUTY_PERIOD_S = 0.03
"""The period of the slow island's stops (`--duty-period-s`): stopped 20 ms of every 30 ms at the default factor,
closer to a machine that is slower all the time than the 0.3 s used until 2026-12-07. A stop that falls into a
wait for the module versions counts whole as idle (up to 2/3 of the period): at 0.3 s that put the slow island's
idle share at 2.7-4.6 % beside 1.8-2.1 % for the fast ones, at 0.03 s at 1.9 % (docs/LOG.md 2026-12-07
session 8). The slow-down is the same at both (round's slow leases 2.3-2.6x the fast ones')."""
SLOW_FACTOR = 3.0
"""The slow island runs 1/SLOW_FACTOR of every duty period."""
ISLAND_NICE = 10
"""The islands' nice value: the coordinator stands for a host of its own, which it is on any real deployment;
here it shares 2 cores with 4 islands that train flat out, and at nice 0 it waits for a core behind them
(docs/LOG.md 2026-12-04 session 3: the same run's idle share 7.8 % at nice 0, 4.6 % at nice 10)."""
POLL_S = 0.5
FAIR_START_S = 3.0
"""How long the islands stay stopped once the run started (longer than the 2 s Retry-After of idle islands)."""
LEASE_TTL_S = 120.0
"""Longer than any stall: a stalled island's lease must not expire (the stall is a hang, not a departure)."""
NUM_ROUNDS = 10_000
"""Never reached (the budget ends every run); the inner LR schedule spans rounds x H, so it stays near its peak."""

PRESETS: dict[str, dict[str, Any]] = {
    "full": {"budget_s": 180.0, "inner_steps": 30, "min_inner_steps": 10, "max_inner_steps": 60, "batch_size": 16,
             "points": 6, "refine": 3, "eval_docs": 200, "docs_per_domain": 200},
    "quick": {"budget_s": 20.0, "inner_steps": 10, "min_inner_steps": 4, "max_inner_steps": 20, "batch_size": 8,
              "points": 3, "refine": 1, "eval_docs": 30, "docs_per_domain": 100},
}  # fmt: skip


@dataclass(kw_only=True, slots=True)
class Config:
    budget_s: float
    """Wall seconds of training per mode, from the moment the islands ask for their first leases."""
    inner_steps: int
    min_inner_steps: int
    max_inner_steps: int
    batch_size: int
    points: int
    """Held-out scores per mode, evenly over the budget (the last at its end)."""
    refine: int
    """Bisections of the time to reach round's final perplexity."""
    eval_docs: int
    docs_per_domain: int
    seed: int
    parts: frozenset[int]
    slow_factor: float = SLOW_FACTOR
    duty_period_s: float = DUTY_PERIOD_S
    island_nice: int = ISLAND_NICE
    stall_leases: float = 3.0
    modes: tuple[str, ...] = MODES
    """Modes to run, round first (the others are judged against it)."""
    damping: str = "inverse"
    """The async levels' `staleness_damping` (1/(1+s), 1/(1+s)^2, or none)."""
    max_staleness: int | None = None
    """The run's `max_staleness` for async levels (None: the run default)."""
    postgres: bool = False
    """Each mode's coordinator on a fresh PostgreSQL database instead of SQLite."""
    path_leases: int | None = None
    """The async run's `path_leases` (path sharing: leases that may train one path at once; None: the run
    default, 2)."""
    async_outer_lr: float | None = None
    """The async and hybrid runs' outer learning rate (None: the run default, half of round's)."""
    async_outer_momentum: float | None = None
    """The async and hybrid runs' outer momentum on async levels (None: the run default, 0.6)."""


# ------------------------------------------------------------------------------------------ signals from outside


def _signal(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


class Throttle(threading.Thread):
    """A ~`factor`x slower machine seen from outside the process: SIGSTOP for (1 - 1/factor) of every period,
    SIGCONT for the rest; left continued whatever happens."""

    def __init__(self, pid: int, *, factor: float = SLOW_FACTOR, period_s: float = DUTY_PERIOD_S) -> None:
        super().__init__(name=f"throttle-{pid}", daemon=True)
        self.pid, self.period_s, self.stopped_s = pid, period_s, period_s * (1 - 1 / factor)
        self._done = threading.Event()

    def run(self) -> None:
        try:
            while not self._done.is_set():
                _signal(self.pid, signal.SIGSTOP)
                if self._done.wait(self.stopped_s):
                    break
                _signal(self.pid, signal.SIGCONT)
                self._done.wait(self.period_s - self.stopped_s)
        finally:
            _signal(self.pid, signal.SIGCONT)

    def stop(self) -> None:
        self._done.set()
        if self.is_alive():
            self.join()
        _signal(self.pid, signal.SIGCONT)


@contextlib.contextmanager
def stalled(*pids: int) -> Iterator[None]:
    """The processes stopped (SIGSTOP) inside the block, continued on leaving it whatever happens."""
    try:
        for pid in pids:
            _signal(pid, signal.SIGSTOP)
        yield
    finally:
        for pid in pids:
            _signal(pid, signal.SIGCONT)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # SIGTERM: the same clean-up as Ctrl-C (every `finally` and `except BaseException`)


# ----------------------------------------------------------------------------------------------- one run


@dataclass(slots=True)
class Timeline:
    """module id -> {version: epoch seconds it appeared}, from polling the registry."""

    seen: dict[int, dict[int, float]] = field(default_factory=dict)

    def observe(self, modules: Sequence[ModulePublic]) -> None:
        for m in modules:
            self.seen.setdefault(m.id, {}).setdefault(m.version, m.updated_at.timestamp())

    def at(self, t: float) -> dict[int, int]:
        """The newest seen version of each module at time t."""
        return {mid: max((v for v, at in vs.items() if at <= t), default=min(vs)) for mid, vs in self.seen.items()}

    def appeared(self, versions: Mapping[int, int]) -> float:
        return max(self.seen[mid][v] for mid, v in versions.items())


@dataclass(slots=True)
class Trial:
    """What one mode's run did, read back over REST (times in epoch seconds)."""

    mode: str
    service: LocalService
    run_id: int
    t0: float
    t_end: float
    """End of the budget."""
    island_ids: list[int]
    """In start order; the last one is the slow island."""
    timeline: Timeline
    contributions: list[ContributionSummary] = field(default_factory=list)
    leases: list[LeaseSummary] = field(default_factory=list)
    events: list[EventPublic] = field(default_factory=list)
    stall: tuple[float, float, int] | None = None
    """(start, end, island id) of part 3's stall."""
    island_logs: list[Path] = field(default_factory=list)
    """Each island's log, in `island_ids` order (overlap leases log how long they waited for their versions)."""

    def accepted(self, until: float) -> list[ContributionSummary]:
        return [c for c in self.contributions if c.created_at.timestamp() <= until]

    def tokens(self, until: float) -> int:
        return sum(c.tokens for c in self.accepted(until))

    def refused(self, until: float) -> int:
        kind = EventKind.UPLOAD_REFUSED
        return sum(e.kind == kind and e.created_at.timestamp() <= until for e in self.events)

    def lease_seconds(self, island_id: int) -> list[float]:
        done = {c.lease_id: c.created_at.timestamp() for c in self.accepted(self.t_end)}
        return [done[x.id] - x.issued_at.timestamp() for x in self.leases if x.island_id == island_id and x.id in done]

    def landed_wait(self, island_id: int) -> float:
        """Seconds the island waited, within leases accepted in the budget, for the module versions of its overlap
        leases (before their first inner step, after their last), from its log lines (`island.worker.OVERLAP_WAIT`)."""
        index = self.island_ids.index(island_id)
        if index >= len(self.island_logs) or not self.island_logs[index].exists():
            return 0.0
        text = " ".join(self.island_logs[index].read_text(errors="replace").split())  # undo the log's wrapping
        record = re.compile(rf"round (\d+) path (\d+): loss (?:(?!round \d+ path).)*?{OVERLAP_WAIT} ([0-9.]+) s")
        done = {(c.round, c.path_index) for c in self.accepted(self.t_end) if c.island_id == island_id}
        return sum(float(w) for r, p, w in record.findall(text) if (int(r), int(p)) in done)

    def idle_share(self, island_id: int) -> float:
        """Share of [t0, t_end] the island held no lease, or waited inside an overlap lease for its versions."""
        done = {c.lease_id: c.created_at.timestamp() for c in self.contributions}
        refused = {e.lease_id: e.created_at.timestamp() for e in self.events if e.kind == EventKind.UPLOAD_REFUSED}
        spans = []
        for x in self.leases:
            if x.island_id != island_id or x.status == LeaseStatus.OFFERED:
                continue
            end = done.get(x.id) or refused.get(x.id)
            if end is None:
                end = x.expires_at.timestamp() if x.status == LeaseStatus.EXPIRED else self.t_end
            spans.append((max(self.t0, x.issued_at.timestamp()), min(self.t_end, end)))
        busy, reach = 0.0, self.t0
        for start, end in sorted(spans):
            busy += max(0.0, end - max(start, reach))
            reach = max(reach, end)
        return 1.0 - (busy - self.landed_wait(island_id)) / (self.t_end - self.t0)

    def turnarounds(self) -> list[float]:
        """Seconds from each accepted upload to its island's next lease (within the budget): the idle gaps."""
        done = {c.lease_id: c.created_at.timestamp() for c in self.accepted(self.t_end)}
        gaps = []
        for island in self.island_ids:
            issued = sorted(
                (x.issued_at.timestamp(), x.id)
                for x in self.leases
                if x.island_id == island and x.status != LeaseStatus.OFFERED
            )
            gaps += [nxt - done[lid] for (_, lid), (nxt, _) in zip(issued, issued[1:], strict=False) if lid in done]
        return gaps

    def path_switches(self) -> int:
        """Accepted leases whose island had trained another path in its lease before (each one trains a path
        from another island's AdamW state, or none)."""
        last: dict[int, int] = {}
        switches = 0
        for c in sorted(self.accepted(self.t_end), key=lambda c: c.id):
            switches += last.get(c.island_id, c.path_index) != c.path_index
            last[c.island_id] = c.path_index
        return switches

    def accepted_during_stall(self) -> int:
        assert self.stall is not None
        start, end, island = self.stall
        return sum(c.island_id != island and start <= c.created_at.timestamp() <= end for c in self.contributions)


def hybrid_layout(layout: str) -> str:
    """The layout with its embedding and head levels async (the blocks keep the run's `round`)."""
    items = [item.strip() for item in layout.split(",")]
    return ", ".join(f"{item}:async" if item.split(":")[0] in ("embed", "head") else item for item in items)


def run_spec(mode: str, layout: str, cfg: Config) -> RunCreate:
    spec: dict[str, Any] = {
        "name": f"bench-async-{mode}",
        "model": {"flavour": "debug"},
        "layout": hybrid_layout(layout) if mode == "hybrid" else layout,
        "sync": "async" if mode in ("async", "overlap") else "round",
        "inner": {"batch_size": cfg.batch_size, "lr": 3e-3, "warmup_steps": 10},
        "inner_steps": cfg.inner_steps,
        "num_rounds": NUM_ROUNDS,
        "seed": cfg.seed,
        "lease_ttl_s": LEASE_TTL_S,
    }
    if mode in ("async", "overlap"):  # dynamic local updates are for all-async runs only
        spec |= {"min_inner_steps": cfg.min_inner_steps, "max_inner_steps": cfg.max_inner_steps}
        spec["overlap"] = mode == "overlap"
        if cfg.path_leases is not None:
            spec["path_leases"] = cfg.path_leases
    if mode != "round":
        spec["staleness_damping"] = cfg.damping
        if cfg.max_staleness is not None:
            spec["max_staleness"] = cfg.max_staleness
        outer = {"async_lr": cfg.async_outer_lr, "async_momentum": cfg.async_outer_momentum}
        if any(v is not None for v in outer.values()):
            spec["outer"] = {k: v for k, v in outer.items() if v is not None}
    return RunCreate.model_validate(spec)


def watch(service: LocalService, run_id: int, timeline: Timeline, until: float, *, lease_of: int | None = None) -> None:
    """Poll the modules into `timeline` until `until` (or, with `lease_of`, until that island holds an active
    lease); raise if a process died."""
    while time.time() < until:
        timeline.observe(service.client.modules(run_id=run_id))
        dead = [(n, p.returncode) for n, p in service.procs if p.poll() is not None]
        if dead:
            raise ServiceError(f"{dead} exited during the run; last lines:\n{tail(service.logs / f'{dead[0][0]}.log')}")
        if lease_of is not None and service.client.leases(run_id=run_id, island_id=lease_of, status=LeaseStatus.ACTIVE):
            return
        time.sleep(POLL_S if lease_of is None else 0.1)
    if lease_of is not None:
        raise ServiceError(f"island {lease_of} took no lease in time")


def stop_islands(service: LocalService) -> None:
    """SIGTERM every island at once (each may sit in a 10 s long poll), wait for them, kill what is left."""
    islands = [(name, proc) for name, proc in service.islands() if proc.poll() is None]
    for _, proc in islands:
        proc.send_signal(signal.SIGCONT)
        proc.terminate()
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for name, proc in islands:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        if proc.poll() is None:
            print(f"  {name} did not stop within {STOP_TIMEOUT_S:.0f} s; killing it")
            proc.kill()
            proc.wait()


def snapshot(service: LocalService, trial: Trial) -> None:
    """Read the run's contributions, leases and events into `trial`."""
    client, run_id = service.client, trial.run_id
    trial.contributions = client.contributions(run_id=run_id)
    trial.leases = client.leases(run_id=run_id)
    trial.events = client.events(run_id=run_id)


def train(mode: str, cfg: Config, *, layout: str, shards_dir: Path, workdir: Path, stall_s: float | None) -> Trial:
    """Start a coordinator and the islands, train `mode` for the budget and, with part 3, stall a fast island
    for `stall_s` (None: `stall_leases` of its median lease in this run). The islands are stopped on return;
    the coordinator is left up for scoring in `trial.service` (the caller stops it)."""
    service = LocalService(data_dir=workdir / mode / "data", logs=workdir / mode / "logs")
    throttles: list[Throttle] = []

    def throttle(pid: int) -> None:
        for t in throttles:
            t.stop()
        throttles.append(Throttle(pid, factor=cfg.slow_factor, period_s=cfg.duty_period_s))
        throttles[-1].start()

    try:
        # the islands start with the coordinator (they retry until it answers); the slow one slow from the start,
        # so that its join probe, the first guess of dynamic local updates, sees a slow machine
        names = service.start_islands(ISLANDS, prefix=f"{mode}-island", cache_root=workdir / mode / "islands")
        procs = dict(service.islands())
        slow = procs[names[-1]].pid
        for proc in procs.values():
            os.setpriority(os.PRIO_PROCESS, proc.pid, cfg.island_nice)
        throttle(slow)
        service.start()
        run = service.create_run(run_spec(mode, layout, cfg))
        service.wait_islands_joined(names)
        ids = {i.name: i.id for i in service.client.islands()}
        throttles[-1].stop()
        # A fair start: islands idle before the run starts ask again every 2 s (the coordinator's Retry-After);
        # stopped through the registration and longer than that, they all ask at once when continued. Otherwise
        # the first to ask trains 2 paths of round 0 and, with rounds shorter than the coordinator's path
        # reservation (10 s), keeps them while the last ones never get a path.
        with stalled(*(p.pid for p in procs.values())):
            register_shards(shards_dir, client=service.client, run_id=run.id)
            time.sleep(FAIR_START_S)
        t0 = time.time()
        throttle(slow)
        trial = Trial(mode, service, run.id, t0, t0 + cfg.budget_s, [ids[n] for n in names], Timeline())
        trial.island_logs = [service.logs / f"{n}.log" for n in names]
        watch(service, run.id, trial.timeline, trial.t_end)
        trial.t_end = time.time()
        if 3 in cfg.parts:
            snapshot(service, trial)
            fast = max(trial.island_ids[:-1], key=lambda i: len(trial.lease_seconds(i)))
            if stall_s is None:
                if not trial.lease_seconds(fast):
                    raise ServiceError("no fast island finished a lease within the budget: raise --budget-s")
                stall_s = cfg.stall_leases * statistics.median(trial.lease_seconds(fast))
            watch(service, run.id, trial.timeline, time.time() + LEASE_TTL_S / 2, lease_of=fast)
            start = time.time()
            with stalled(procs[names[trial.island_ids.index(fast)]].pid):
                watch(service, run.id, trial.timeline, start + stall_s)
            trial.stall = (start, time.time(), fast)
        throttles[-1].stop()
        snapshot(service, trial)
        stop_islands(service)
        return trial
    except BaseException:
        for t in throttles:
            t.stop()
        stop_islands(service)
        service.stop()
        raise


# ------------------------------------------------------------------------------------------------ scoring


class Scorer:
    """Routed held-out perplexity of a run's paths at given module versions (weights over REST, cached)."""

    def __init__(self, service: LocalService, run_id: int, router: Router, documents: list[str]) -> None:
        self.paths = fetch_run_paths(service.client, run_id)
        self.weights = VersionedWeights(service.client)
        self.router, self.documents = router, documents
        self._cache: dict[tuple[tuple[int, int], ...], EvalResult] = {}

    def __call__(self, versions: Mapping[int, int]) -> float:
        return self.result(versions).perplexity

    def per_path(self, versions: Mapping[int, int]) -> list[float | None]:
        """Each path's perplexity on the held-out documents routed to it."""
        return [p.perplexity for p in self.result(versions).per_path]

    def result(self, versions: Mapping[int, int]) -> EvalResult:
        key = tuple(sorted(versions.items()))
        if key not in self._cache:
            cfg = self.paths.config

            def build(p: int) -> torch.nn.Module:
                return build_path(cfg, [self.weights.get(m.id, versions[m.id]) for m in self.paths.modules[p]])

            self._cache[key] = evaluate_routed(
                build, self.router, self.documents, prefix_tokens=self.router.prefix_tokens, context=cfg.seq_len
            )
        return self._cache[key]


def score(trial: Trial, scorer: Scorer, cfg: Config, *, target: dict[str, float] | None) -> dict[str, Any]:
    """Part 1's numbers of one trial; `target` (round's final `ppl` and `tokens`) for the other modes."""
    tl, t0 = trial.timeline, trial.t0
    times = [t0 + (trial.t_end - t0) * k / cfg.points for k in range(1, cfg.points + 1)]
    curve = [(t - t0, scorer(tl.at(t)), trial.tokens(t)) for t in times]
    final = tl.at(trial.t_end)
    out: dict[str, Any] = {
        "curve": [{"t_s": round(t, 1), "ppl": p, "tokens": n} for t, p, n in curve],
        "final_ppl": curve[-1][1],
        "final_ppl_per_path": scorer.per_path(final),
        "final_state_s": tl.appeared(final) - t0,
        "module_steps": sum(final.values()),
    }
    if target is None:
        return out
    reach = None
    hit = next((k for k, (_, p, _) in enumerate(curve) if p <= target["ppl"]), None)
    if hit is not None:
        low, high = (t0 if hit == 0 else times[hit - 1]), times[hit]
        for _ in range(cfg.refine):
            mid = (low + high) / 2
            low, high = (low, mid) if scorer(tl.at(mid)) <= target["ppl"] else (mid, high)
        reach = high - t0
    out["reach_s"] = reach
    cum = 0
    for c in sorted(trial.accepted(trial.t_end), key=lambda c: c.created_at):
        cum += c.tokens
        if cum >= target["tokens"]:
            out["ppl_at_round_tokens"] = scorer(tl.at(c.created_at.timestamp()))
            out["ppl_at_round_tokens_per_path"] = scorer.per_path(tl.at(c.created_at.timestamp()))
            out["path_tokens_at_round_tokens"] = path_tokens(trial, c.created_at.timestamp())
            out["round_tokens_at_s"] = c.created_at.timestamp() - t0
            break
    return out


def path_tokens(trial: Trial, until: float) -> dict[int, int]:
    """Tokens accepted per path index up to `until`."""
    out: dict[int, int] = {}
    for c in trial.accepted(until):
        out[c.path_index] = out.get(c.path_index, 0) + c.tokens
    return dict(sorted(out.items()))


def _quantiles(xs: list[float]) -> dict[str, float]:
    """Median, 90th percentile and mean (nan when empty)."""
    if not xs:
        return dict.fromkeys(("median", "p90", "mean"), math.nan)
    ordered = sorted(xs)
    return {
        "median": statistics.median(ordered),
        "p90": ordered[int(0.9 * (len(ordered) - 1))],
        "mean": statistics.fmean(ordered),
    }


def counts(trial: Trial) -> dict[str, Any]:
    accepted = trial.accepted(trial.t_end)
    stale = [m.staleness for c in accepted for m in c.modules]
    idle = [trial.idle_share(i) for i in trial.island_ids]
    out: dict[str, Any] = {
        "run_id": trial.run_id,
        "tokens": trial.tokens(trial.t_end),
        "accepted": len(accepted),
        "refused": trial.refused(trial.t_end),
        "mean_staleness": statistics.fmean(stale) if stale else 0.0,
        "path_switches": trial.path_switches(),
        "path_tokens": path_tokens(trial, trial.t_end),
        "lease_s_fast": statistics.median(
            [s for i in trial.island_ids[:-1] for s in trial.lease_seconds(i)] or [math.nan]
        ),
        "lease_s_slow": statistics.median(trial.lease_seconds(trial.island_ids[-1]) or [math.nan]),
        "idle_share": idle,
        "idle_share_mean": statistics.fmean(idle),
        "idle_share_fast": statistics.fmean(idle[:-1]),
        "turnaround_s": _quantiles(trial.turnarounds()),
    }
    if trial.stall is not None:
        out["stall_s"] = trial.stall[1] - trial.stall[0]
        out["accepted_during_stall"] = trial.accepted_during_stall()
    return out


# ------------------------------------------------------------------------------------------------ report


def _ratio(value: float | None, base: float | None) -> str:
    if value is None or base is None or base == 0 or math.isnan(value) or math.isnan(base):
        return "n/a"
    return f"{value / base:.2f}x"


PART1_HELP = """\
  acc/ref: uploads accepted/refused (409 stale); stale: mean staleness of their module parts; sw: leases on
  another path than the island's previous lease; reach: time to round's final ppl over the time round's final
  state appeared (target <= 0.70x); @tok: ppl at round's tokens over round's final ppl (target 0.97-1.03x)"""


def _per_path(tokens: Mapping[int, int], ppl: Sequence[float | None]) -> str:
    """`index: tokens / ppl` for each path (no ppl when no held-out document was routed to it)."""
    return "   ".join(f"{p}: {n:,}" + ("" if ppl[p] is None else f" / {ppl[p]:.2f}") for p, n in tokens.items())


def report(results: dict[str, dict[str, Any]], cfg: Config) -> None:
    base = results["round"]
    if 1 in cfg.parts:
        print(f"\npart 1: held-out perplexity, {cfg.budget_s:.0f} s budget each (ratios vs round)")
        head = ("mode", "tokens", "acc", "ref", "stale", "sw", "final ppl", "reach s", "reach", "ppl@tok", "@tok")
        print("{:7s} {:>9s} {:>4s} {:>4s} {:>5s} {:>3s} {:>9s} {:>8s} {:>6s} {:>8s} {:>6s}".format(*head), end="")
        print("  ppl over time (s:ppl)")
        for mode, r in results.items():
            reach = r.get("reach_s", r["final_state_s"] if mode == "round" else None)
            at_tok = r.get("ppl_at_round_tokens", r["final_ppl"] if mode == "round" else None)
            curve = " ".join(f"{p['t_s']:.0f}:{p['ppl']:.2f}" for p in r["curve"])
            print(
                f"{mode:7s} {r['tokens']:9d} {r['accepted']:4d} {r['refused']:4d} {r['mean_staleness']:5.2f} "
                f"{r['path_switches']:3d} {r['final_ppl']:9.3f} {'never' if reach is None else f'{reach:.1f}':>8s} "
                f"{_ratio(reach, base['final_state_s']):>6s} {'n/a' if at_tok is None else f'{at_tok:.3f}':>8s} "
                f"{_ratio(at_tok, base['final_ppl']):>6s}  {curve}"
            )
        print(PART1_HELP)
        print("  per path (index: tokens accepted in the budget / final held-out ppl on its routed documents):")
        for mode, r in results.items():
            print(f"  {mode:7s} " + _per_path(r["path_tokens"], r["final_ppl_per_path"]))
            if "ppl_at_round_tokens_per_path" in r:
                at = _per_path(r["path_tokens_at_round_tokens"], r["ppl_at_round_tokens_per_path"])
                print(f"  {'@tok':7s} " + at)
    if 2 in cfg.parts:
        print("\npart 2: island idle share of wall time (no lease held), first lease to end of budget")
        print(
            f"{'mode':7s} {'mean':>6s} {'fast':>6s} {'slow':>6s} {'vs round':>8s}  lease s fast/slow  "
            "upload -> next lease ms median/p90"
        )
        for mode, r in results.items():
            gap = r["turnaround_s"]
            print(
                f"{mode:7s} {r['idle_share_mean']:6.1%} {r['idle_share_fast']:6.1%} {r['idle_share'][-1]:6.1%} "
                f"{_ratio(r['idle_share_mean'], base['idle_share_mean']):>8s}  "
                f"{r['lease_s_fast']:.1f}/{r['lease_s_slow']:.1f}{'':12s}"
                f"{gap['median'] * 1e3:.0f}/{gap['p90'] * 1e3:.0f}"
            )
        print("  target: async mean <= 2.0 %")
    if 3 in cfg.parts:
        print(f"\npart 3: a fast island SIGSTOPped for {base['stall_s']:.1f} s ({cfg.stall_leases:g} round leases)")
        print(f"{'mode':7s} {'accepted from the others':>24s} {'vs round':>8s}")
        for mode, r in results.items():
            n, b = r["accepted_during_stall"], base["accepted_during_stall"]
            print(f"{mode:7s} {n:24d} {_ratio(n, b):>8s}")


# -------------------------------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None = None) -> tuple[Config, Path, Path]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny settings, everything in < 4 minutes")
    for name in ("budget-s", "inner-steps", "min-inner-steps", "max-inner-steps", "batch-size", "points", "eval-docs"):
        parser.add_argument(f"--{name}", type=float if name == "budget-s" else int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--slow-factor",
        type=float,
        default=SLOW_FACTOR,
        help="the slow island is stopped 1 - 1/this of every duty period",
    )
    parser.add_argument(
        "--duty-period-s",
        type=float,
        default=DUTY_PERIOD_S,
        help=f"the period of the slow island's stops (default {DUTY_PERIOD_S:g} s)",
    )
    parser.add_argument(
        "--island-nice",
        type=int,
        default=ISLAND_NICE,
        help=f"the islands' nice value (default {ISLAND_NICE}: the coordinator stands for a host of its own; 0: as is)",
    )
    parser.add_argument("--parts", default="1,2,3", help="comma-separated subset of 1,2,3")
    parser.add_argument(
        "--modes", default=",".join(MODES), help="comma-separated modes; round must be one (the baseline)"
    )
    parser.add_argument(
        "--damping", choices=("inverse", "inverse_square", "none"), default="inverse", help="async staleness damping"
    )
    parser.add_argument("--max-staleness", type=int, default=None, help="async levels (default: the run default)")
    parser.add_argument(
        "--path-leases", type=int, default=None, help="the async run's path_leases (default: the run's, 2; 1: off)"
    )
    parser.add_argument(
        "--async-outer-lr",
        type=float,
        default=None,
        help="outer.async_lr of the async/hybrid runs, the step size of their async levels (default: the run's, "
        f"{DEFAULT_ASYNC_LR_FACTOR:g} x outer.lr = {DEFAULT_ASYNC_LR_FACTOR * OuterSpec().lr:g})",
    )
    parser.add_argument(
        "--async-outer-momentum",
        type=float,
        default=None,
        help=f"outer.async_momentum of the async/hybrid runs (default: the run's, {DEFAULT_ASYNC_MOMENTUM:g})",
    )
    parser.add_argument(
        "--postgres",
        action="store_true",
        help="each mode's coordinator on a fresh PostgreSQL database (DIPACO_TEST_PG_SERVER, default the local "
        "server), dropped after the mode; default SQLite in the mode's data directory",
    )
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench-async.json"))
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/bench-async-work"), help="corpus and run dirs")
    args = parser.parse_args(argv)
    preset = dict(PRESETS["quick" if args.quick else "full"])
    for key in preset:
        if getattr(args, key, None) is not None:
            preset[key] = getattr(args, key)
    parts = frozenset(int(p) for p in args.parts.split(","))
    if not parts or not parts <= {1, 2, 3}:
        parser.error("--parts takes a comma-separated subset of 1,2,3")
    if args.slow_factor < 1:
        parser.error("--slow-factor must be >= 1")
    if not (math.isfinite(args.duty_period_s) and 0.01 <= args.duty_period_s <= 10):
        parser.error("--duty-period-s must be within 0.01-10 s")
    if not 0 <= args.island_nice <= 19:
        parser.error("--island-nice must be within 0-19")
    wanted = set(args.modes.split(","))
    modes = tuple(m for m in MODES if m in wanted)  # round first: the others are judged against it
    if "round" not in wanted or not wanted <= set(MODES):
        parser.error(f"--modes takes a comma-separated subset of {','.join(MODES)} that includes round")
    config = Config(
        **preset,
        seed=args.seed,
        parts=parts,
        slow_factor=args.slow_factor,
        duty_period_s=args.duty_period_s,
        island_nice=args.island_nice,
        modes=modes,
        damping=args.damping,
        max_staleness=args.max_staleness,
        path_leases=args.path_leases,
        async_outer_lr=args.async_outer_lr,
        async_outer_momentum=args.async_outer_momentum,
        postgres=args.postgres,
    )
    return config, args.out, args.workdir


@contextlib.contextmanager
def mode_database(*, postgres: bool) -> Iterator[None]:
    """With `postgres`, a fresh PostgreSQL database for the coordinator started inside (its settings read
    DIPACO_DATABASE_URL; the islands ignore it), dropped on the way out; else nothing (SQLite in the data dir)."""
    if not postgres:
        yield
        return
    url = pg_database()
    os.environ["DIPACO_DATABASE_URL"] = url
    try:
        yield
    finally:
        del os.environ["DIPACO_DATABASE_URL"]
        drop_pg(url)


def main(argv: Sequence[str] | None = None) -> int:
    cfg, out, workdir = parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = os.environ["DIPACO_TORCH_THREADS"] = "1"  # every subprocess inherits these
    torch.set_num_threads(1)
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # also when started in the background
    two_by_two = next(c for c in contenders("debug") if c.levels == (2, 2))
    settings = QualitySettings(seed=cfg.seed)
    corpus_dir = workdir / f"corpus-{cfg.docs_per_domain}"
    prepare_corpus(corpus_dir, docs_per_domain=cfg.docs_per_domain)
    shards_dir = shards_for(corpus_dir, workdir / f"shards-{cfg.docs_per_domain}", two_by_two.levels, settings)
    halves = split_heldout(load_documents(corpus_dir, "heldout"), max_docs=cfg.eval_docs)
    documents, router = [d for h in HALVES for d in halves[h]], Router.load(shards_dir / ROUTER_DIR)
    rundir = workdir / f"run-{time.strftime('%Y%m%d-%H%M%S')}"
    print(
        f"{two_by_two.layout}; debug; {ISLANDS} islands, the last one {cfg.slow_factor:g}x slow "
        f"(stopped {1 - 1 / cfg.slow_factor:.0%} of every {cfg.duty_period_s:g} s); "
        f"islands at nice {cfg.island_nice}; {cfg.budget_s:g} s per mode; "
        f"H {cfg.inner_steps} (async {cfg.min_inner_steps}..{cfg.max_inner_steps}), "
        f"batch {cfg.batch_size}; seed {cfg.seed}; parts {','.join(map(str, sorted(cfg.parts)))}; "
        f"database {'postgresql' if cfg.postgres else 'sqlite'}; "
        f"modes {','.join(cfg.modes)}; damping {cfg.damping}; max_staleness {cfg.max_staleness}; "
        f"path_leases {cfg.path_leases}; outer.async_lr {cfg.async_outer_lr or 'run default'}; "
        f"outer.async_momentum {cfg.async_outer_momentum if cfg.async_outer_momentum is not None else 'run default'}"
    )
    print(f"logs and registries: {rundir}")

    results: dict[str, dict[str, Any]] = {}
    stall_s: float | None = None
    started = time.monotonic()
    for mode in cfg.modes:
        t = time.monotonic()
        with mode_database(postgres=cfg.postgres):
            trial = train(mode, cfg, layout=two_by_two.layout, shards_dir=shards_dir, workdir=rundir, stall_s=stall_s)
            try:
                r = counts(trial)
                stall_s = r.get("stall_s", stall_s)  # every mode stalls as long as round did
                if 1 in cfg.parts:
                    base = results.get("round")
                    target = None if base is None else {"ppl": base["final_ppl"], "tokens": base["tokens"]}
                    r |= score(trial, Scorer(trial.service, trial.run_id, router, documents), cfg, target=target)
            finally:
                trial.service.stop()
        results[mode] = r
        print(f"  {mode}: {r['tokens']} tokens, {r['accepted']} accepted, {r['refused']} refused "
              f"({time.monotonic() - t:.0f} s)", flush=True)  # fmt: skip
    report(results, cfg)
    print(f"\ntotal {time.monotonic() - started:.0f} s")
    out.write_text(json.dumps({"config": {**asdict(cfg), "parts": sorted(cfg.parts)}, "results": results}, indent=1))
    print(f"numbers: {out}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("interrupted; every process started here was stopped")
        sys.exit(130)
