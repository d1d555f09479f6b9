"""The island loop (DiLoCo inner phase, arXiv 2311.08105 Alg. 1; DiPaCo §2.2): join, then repeatedly
lease a path, fetch its modules and tokens, run H AdamW steps, upload the per-module outer gradients.

Exit codes of `Island.run()`:
  0    done: the run finished (or nothing runs and `exit_when_idle`), or `max_rounds` leases were trained
  1    a request was rejected (4xx other than 409/429), a malformed lease, or an unexpected error
  3    the coordinator stayed unreachable for `give_up_after_s` (`CoordinatorUnavailable`)
  4    downloaded bytes failed their sha256 check twice in a row (`IntegrityError`)
  128+N  stopped by signal N after the current step (130 for SIGINT, 143 for SIGTERM); the lease was released
A second SIGINT/SIGTERM exits at once with 128+N, without releasing anything (the lease then expires).
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import math
import os
import signal
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, Literal

import torch
from rich.console import Console

from coordinator.schemas import GRAD_KEY_SEP, ContributionPublic, LeaseModule, LeasePublic
from island.cache import BlobCache
from island.capabilities import capabilities, resolve_device
from island.client import CoordinatorClient, RetryPolicy
from island.distributed import Leader, group_failure, init_group, rank_device
from island.errors import ClientError, CoordinatorUnavailable, IntegrityError, IslandError, LeaseLost
from island.faults import Stall
from island.heartbeat import Heartbeater
from island.inner import Ranks, inner_phase
from island.optimizer_state import InnerStates
from island.progress import LeaseProgress
from modules import (
    CodecError,
    ErrorFeedback,
    InnerConfig,
    ModelConfig,
    PathModel,
    batches_from_tokens,
    build_path,
    decode,
    encode_grad,
    heldout_loss,
    make_optimizer,
    pseudo_gradient,
    touched_rows,
)
from modules.asynchrony import rebase
from modules.sparse_rows import SPARSE_LEVEL, SPARSE_PARAM

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_UNAVAILABLE = 3
EXIT_INTEGRITY = 4
CLEANUP_GIVE_UP_S = 10.0
"""Retry budget of the best-effort release/leave calls on the way out."""


def default_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


@dataclass(kw_only=True, slots=True)
class IslandConfig:
    """Everything an island needs to join a run and work."""

    coordinator: str
    """Base URL of the coordinator, e.g. http://127.0.0.1:8000."""
    token: str
    """Join token (bearer); the coordinator hands back an island token on join."""
    name: str = field(default_factory=default_name)
    """Island name shown on the dashboard; hostname-pid by default."""
    site: str = "local"
    """Site label (data centre, lab, ...), for grouping islands."""
    device: str = "auto"
    """"auto" (cuda if available, else cpu), "cpu", "cuda" or "cuda:N"."""
    cache_dir: Path = Path("~/.cache/dipaco/island")
    """Content-addressed cache of module weights and shard tokens."""
    max_rounds: int | None = None
    """Stop after this many uploaded leases; None = until the run is finished."""
    exit_when_idle: bool = False
    """Exit 0 when no run is running, even if this island has not trained anything yet."""
    lease_wait_s: float = 10.0
    """Long polling: how long the coordinator may hold a lease request while there is no work (0 = poll)."""
    give_up_after_s: float = 300.0
    """How long one coordinator call keeps retrying before the island exits with code 3."""
    max_backoff_s: float = 30.0
    """Largest sleep between two retries of one call (full jitter below it)."""
    probe: bool = True
    """Measure tokens/s with a few debug-model steps (< 1 s) before joining, for the capabilities."""
    seed_offset: int = 0
    """Added to each lease's seed before seeding torch, so islands can differ when they need to."""
    ca_file: Path | None = None
    """PEM file of the certificate authority to trust for an https coordinator (default: the system's)."""
    overlap_wait: float = 0.1
    """An overlap lease waits before its first inner step for the module versions it was issued ahead of, up to this
    share of its expected training time (the island's last lease's time per step x H), and trains on through them
    from its own end weights only if they have not landed by then (0: train through at once). Steps taken at the
    end weights cost held-out perplexity per token (docs/LOG.md, 2026-12-06 session 4), waiting costs idle time."""
    optimizer_cache: int = 4
    """Paths whose inner AdamW state a single-process island keeps (DiLoCo keeps inner state across rounds; an
    island that trains several paths per round resumes each). Multi-process islands keep the last one only."""
    quiet: bool = False
    """No progress bar (log lines only)."""
    handle_signals: bool = True
    """Install SIGINT/SIGTERM handlers while `run()` runs (only possible in the main thread)."""

    def __post_init__(self) -> None:
        if not self.coordinator.startswith(("http://", "https://")):
            raise ValueError(f"coordinator URL must start with http:// or https://, got {self.coordinator!r}")
        if not self.token:
            raise ValueError("a join token is required (--token or DIPACO_JOIN_TOKEN)")
        if not 0 <= self.lease_wait_s <= 60:
            raise ValueError(f"lease wait must be within 0-60 s, got {self.lease_wait_s}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.max_rounds is not None and self.max_rounds < 1:
            raise ValueError(f"max_rounds must be >= 1 or None, got {self.max_rounds}")
        if self.give_up_after_s < 0:
            raise ValueError(f"give_up_after_s must be >= 0, got {self.give_up_after_s}")
        if not (math.isfinite(self.overlap_wait) and self.overlap_wait >= 0):
            raise ValueError(f"overlap_wait must be a finite share >= 0 of a lease's time, got {self.overlap_wait}")
        if self.optimizer_cache < 1:
            raise ValueError(f"optimizer_cache must be >= 1, got {self.optimizer_cache}")
        if not self.max_backoff_s > 0:
            raise ValueError(f"max_backoff_s must be > 0, got {self.max_backoff_s}")
        self.cache_dir = Path(self.cache_dir).expanduser()


@dataclass(slots=True)
class LeaseResult:
    """What happened to one lease (kept on `Island.results`, for the summary and for tests)."""

    lease_id: int
    round: int
    path_index: int
    status: Literal["uploaded", "lost", "stopped"]
    losses: list[float] = field(default_factory=list)
    tokens: int = 0
    tokens_per_s: float = 0.0
    upload_bytes: int = 0
    download_bytes: int = 0
    """Bytes fetched from the coordinator for this lease (cache misses only)."""
    fetch_s: float = 0.0
    """Seconds spent getting weights and tokens (cache or network) and composing the path."""
    train_s: float = 0.0
    """Seconds spent in the H inner steps."""
    upload_s: float = 0.0
    """Seconds spent encoding and uploading the outer gradients."""
    heldout_loss: float | None = None
    """The start weights' mean loss on the path's held-out slice (`LeasePublic.heldout`), when the run keeps one."""
    landed_wait_s: float | None = None
    """Overlap leases: seconds the island waited for the versions it was issued ahead of (before its first inner
    step, up to `IslandConfig.overlap_wait` of the lease, and after its last, if it trained through them)."""
    rebased_at: int | None = None
    """Overlap leases: inner steps taken before the model moved onto the landed versions (H: after the last)."""


@dataclass(frozen=True, slots=True)
class _Inputs:
    """What one lease trains on, fetched and checked before any step runs."""

    where: str
    """"lease L (run R, round N, path P)", for messages."""
    model_cfg: ModelConfig
    inner: InnerConfig
    levels: list[LeaseModule]
    """The path's modules in level order."""
    base: list[dict[str, torch.Tensor]]
    """Their weights (the lease's base versions), in the same order."""
    tokens: torch.Tensor
    """The lease's token range of the shard (int64)."""
    heldout: torch.Tensor | None = None
    """The tokens of the path's held-out slice to score the start weights on (int64), when the run keeps one."""
    pending: list[int] = field(default_factory=list)
    """Overlap lease: indices of `levels` whose version has not landed yet; their `base` is the island's own end
    weights of the path until `_Rebase` moves the model onto the landed version."""


@dataclass(frozen=True, slots=True)
class _EndWeights:
    """The trained weights of the island's last accepted lease, per module id: where an overlap lease on the same
    path starts (`_Rebase`)."""

    run_id: int
    path_id: int
    modules: dict[int, dict[str, torch.Tensor]]


INTERRUPT_CHECK_S = 0.1
"""How often an overlap lease waiting for its versions before its first step looks for a stop or a lost lease."""

LANDED_WAIT_S = 5.0
"""Long polling of an overlap lease's pending module versions (they land with a module step: well under this)."""

LANDED_FETCHES = 4
"""An overlap lease's landed versions fetched at once, at most (one per pending module)."""


class _Rebase:
    """An overlap lease's pending module versions, fetched on a thread while the inner steps run. When they land,
    each pending module's weights move by (landed version - end weights it started from): the model then holds
    the landed version plus what the steps so far trained, as if it had started there, and the outer gradient is
    taken against the landed version (`inputs.base`)."""

    def __init__(
        self, future: Future[dict[int, dict[str, torch.Tensor]]], inputs: _Inputs, *, wait_s: float = 0.0
    ) -> None:
        self._future = future
        self._inputs = inputs
        self._wait_s = wait_s
        self.at: int | None = None
        """Inner steps taken before the rebase; None until it happened."""
        self.waited_first_s = 0.0
        """Seconds waited for the versions before the first inner step."""
        self.waited_s = 0.0
        """Seconds waited for the versions in all (before the first step and after the last)."""

    def wait_first(self, interrupted: Callable[[], bool]) -> None:
        """Before the first inner step: wait up to `wait_s` for the versions, or until `interrupted()` (a stop
        request, a lost lease: the caller checks those next)."""
        t0 = time.perf_counter()
        deadline = t0 + self._wait_s
        while not self._future.done() and not interrupted() and (left := deadline - time.perf_counter()) > 0:
            wait_futures([self._future], timeout=min(left, INTERRUPT_CHECK_S))
        self.waited_first_s = time.perf_counter() - t0
        self.waited_s += self.waited_first_s

    def maybe(self, model: PathModel, step: int) -> None:
        """Before inner step `step`: rebase if the versions landed (a failed fetch is raised by `finish`)."""
        if self.at is None and self._future.done() and self._future.exception() is None:
            self._apply(model)
            self.at = step

    def finish(self, model: PathModel, steps: int) -> None:
        """After the `steps` inner steps: wait for the versions if they have not landed yet, and rebase."""
        if self.at is None:
            t0 = time.perf_counter()
            self._apply(model)
            self.waited_s += time.perf_counter() - t0
            self.at = steps

    def _apply(self, model: PathModel) -> None:
        landed = self._future.result()
        rebase(model, [(weights, self._inputs.base[index]) for index, weights in landed.items()])
        for index, weights in landed.items():
            self._inputs.base[index] = weights


class Island:
    """One worker island. `run()` blocks until done and returns the process exit code."""

    def __init__(
        self,
        config: IslandConfig,
        *,
        client: CoordinatorClient | None = None,
        console: Console | None = None,
        ranks: Ranks | None = None,
    ) -> None:
        self.config = config
        self.ranks = ranks if ranks is not None else Ranks()
        """Rank 0 of a multi-process island when world_size > 1 (see island.distributed)."""
        if self.ranks.rank != 0:
            raise ValueError("only rank 0 runs an Island; the other ranks run island.distributed.Follower")
        retry = RetryPolicy(
            give_up_after_s=config.give_up_after_s, cap_s=max(config.max_backoff_s, RetryPolicy().base_s)
        )
        self.client = (
            client
            if client is not None
            else CoordinatorClient(config.coordinator, config.token, retry=retry, ca_file=config.ca_file)
        )
        self.console = console if console is not None else Console(stderr=True)
        self.cache = BlobCache(config.cache_dir)
        self.results: list[LeaseResult] = []
        self._stop = threading.Event()
        self._signum: int | None = None
        self._heartbeat: Heartbeater | None = None
        self._joined = False
        self._lease: LeasePublic | None = None
        """The lease being worked on; released on the way out if still set."""
        self._asking: Future[LeasePublic | None] | None = None
        """The next lease request, sent as soon as an upload was accepted (`_ask_early`)."""
        self._asker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dipaco-next-lease")
        self._inner_states = InnerStates(1 if self.ranks.distributed else config.optimizer_cache)
        """Inner AdamW state of accepted leases; multi-process islands keep the last one only (followers hold
        their own copy of it)."""
        self._residuals = InnerStates(config.optimizer_cache)
        """Error-feedback residual of the run's codec per (run, path), kept like the inner state (rank 0 only)."""
        self._ends: _EndWeights | None = None
        """The trained weights of the last accepted lease, while the lease its reply brought trains through that
        path's module steps (an overlap lease starts there; one copy of the path's weights in memory)."""
        self._fetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dipaco-landed-weights")
        self._landed_modules = ThreadPoolExecutor(max_workers=LANDED_FETCHES, thread_name_prefix="dipaco-landed-module")
        """The fetches of an overlap lease's landed versions, side by side (`_landed_weights`)."""
        self._leader: Leader | None = None
        self._stall = Stall.from_env()
        self._downloaded = 0
        """Bytes downloaded for the lease being prepared."""
        self._downloaded_lock = threading.Lock()
        """`_downloaded` is added to by the fetch threads too."""
        self.device = torch.device("cpu")

    @property
    def rounds_done(self) -> int:
        return sum(r.status == "uploaded" for r in self.results)

    # -- stopping ----------------------------------------------------------------------------------------

    def request_stop(self, signum: int) -> None:
        """Stop after the current step, release the lease, leave; `run()` returns 128 + signum."""
        if not self._stop.is_set():
            log.warning(
                "%s: stopping after the current step (send again to exit at once)",
                signal.Signals(signum).name,
            )
        self._signum = signum
        self._stop.set()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._stop.is_set():
            log.error("second %s: exiting now", signal.Signals(signum).name)
            os._exit(128 + signum)
        self.request_stop(signum)

    @contextlib.contextmanager
    def _signals(self) -> Iterator[None]:
        if not self.config.handle_signals or threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    # -- main loop -----------------------------------------------------------------------------------------

    def run(self) -> int:
        with self._signals():
            try:
                code = self._run()
            except CoordinatorUnavailable as exc:
                log.error("%s", exc)
                code = EXIT_UNAVAILABLE
            except IntegrityError as exc:
                log.error("%s", exc)
                code = EXIT_INTEGRITY
            except (IslandError, ClientError) as exc:
                log.error("%s", exc)
                code = EXIT_ERROR
            except Exception as exc:
                failed = group_failure(exc) if self._leader is not None else None
                if failed is None:
                    log.exception("island crashed")
                else:
                    log.error("a follower rank is gone or stuck (the island's process group failed: %s)", failed)
                code = EXIT_ERROR
            finally:
                self._shutdown()
        if self._signum is not None:
            return 128 + self._signum
        return code

    def _run(self) -> int:
        self.device = resolve_device(self.config.device)
        cfg = self.config
        if self.ranks.distributed:
            self.device = rank_device(self.device)
            init_group(self.ranks, self.device)
            self._leader = Leader(self.ranks, self.device)
        caps = capabilities(self.device, probe=cfg.probe)
        if _in_clear(cfg.coordinator):
            log.warning(
                "talking to %s over plain http: the tokens, weights and data travel in clear (use https)",
                cfg.coordinator,
            )
        joined = self.client.join(cfg.name, cfg.site, caps)
        self._joined = True
        log.info(
            "joined %s as island %d (%s, device %s x %d process(es), probe %s tok/s)",
            cfg.coordinator,
            joined.island_id,
            cfg.name,
            self.device,
            self.ranks.world_size,
            caps.tokens_per_s,
        )
        self._heartbeat = Heartbeater(self.client, interval_s=joined.heartbeat_interval_s)
        self._heartbeat.start()
        while not self._stop.is_set():
            self._check_fatal()
            if cfg.max_rounds is not None and self.rounds_done >= cfg.max_rounds:
                log.info("trained %d lease(s), the --max-rounds limit; leaving", self.rounds_done)
                return EXIT_OK
            lease = self._next_lease()
            if lease is not None and self._stop.is_set():  # stopped while the request was held: give it back
                self._lease = lease
                self.results.append(_result(lease, "stopped"))
                break
            if lease is None:
                if self._leave_or_wait():
                    log.info("no run is running; leaving after %d lease(s)", self.rounds_done)
                    return EXIT_OK
                continue
            self._lease = lease
            try:
                self.results.append(self._work(lease))
            except LeaseLost as exc:
                log.warning("%s; discarding its work and asking for new work", exc)
                self.results.append(_result(lease, "lost"))
            self._lease = None
        return EXIT_OK

    def _wants_more(self) -> bool:
        """Whether the island will ask for another lease after this one: not after its last (`--max-rounds`), nor
        when it is stopping."""
        cfg = self.config
        return not (self._stop.is_set() or (cfg.max_rounds is not None and self.rounds_done + 1 >= cfg.max_rounds))

    def _ask_early(self, came: LeasePublic | None) -> None:
        """The coordinator accepted a lease's upload: the next lease is the one its reply carried (`came`), else
        asked for now, on a thread, while the accepted inner state is kept (a copy of the AdamW moments to the CPU,
        ~0.1 s per 150M parameters from a GPU) and the result logged, rather than after; the coordinator may
        still hold the request until work appears. Not when the island wants no more work (`_wants_more`)."""
        if came is not None:
            self._asking = Future()
            self._asking.set_result(came)  # given back on the way out if unused (`_early_lease_left`)
        elif self._wants_more():
            self._asking = self._asker.submit(self.client.lease, wait_s=self.config.lease_wait_s)

    def _next_lease(self) -> LeasePublic | None:
        """The answer to the request `_ask_early` sent, else a new request's."""
        asking, self._asking = self._asking, None
        if asking is not None:
            return asking.result()
        return self.client.lease(wait_s=self.config.lease_wait_s)

    def _early_lease_left(self) -> LeasePublic | None:
        """On the way out: the lease an early request brought and nobody took, to give back. A request still
        held by the coordinator is left to finish: once the island has left, no lease is issued to it."""
        asking, self._asking = self._asking, None
        self._asker.shutdown(wait=False, cancel_futures=True)
        self._fetcher.shutdown(wait=False, cancel_futures=True)
        self._landed_modules.shutdown(wait=False, cancel_futures=True)
        if asking is None or not asking.done() or asking.cancelled() or asking.exception() is not None:
            return None
        return asking.result()

    def _leave_or_wait(self) -> bool:
        """After a lease request found no work: True when the island should leave; else wait as long as the
        coordinator asked (idle followers get a keep-alive first) and return False."""
        idle = self.client.idle
        assert idle is not None
        if idle.reason == "no-running-runs" and (self.rounds_done > 0 or self.config.exit_when_idle):
            return True
        log.debug("no work (%s); asking again in %.1fs", idle.reason, idle.retry_after_s)
        if self._leader is not None:
            self._leader.keepalive()
        self._stop.wait(idle.retry_after_s)
        return False

    def _check_fatal(self) -> None:
        if self._heartbeat is not None and self._heartbeat.fatal is not None:
            raise self._heartbeat.fatal

    def _shutdown(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop()
        budget = self._cleanup_budget_s()
        for lease in (self._lease, self._early_lease_left()):
            if lease is not None:
                with contextlib.suppress(IslandError, ClientError):
                    self.client.release(lease.lease_id, give_up_after_s=budget)
                    log.info("released lease %d", lease.lease_id)
        self._lease = None
        if self._joined:
            with contextlib.suppress(IslandError, ClientError):
                self.client.leave(give_up_after_s=budget)
            self._joined = False
        if self._leader is not None:
            with contextlib.suppress(RuntimeError):  # a follower already gone: nothing left to stop
                self._leader.stop()
            self._leader = None
        self.client.close()

    def _cleanup_budget_s(self) -> float:
        return min(CLEANUP_GIVE_UP_S, self.config.give_up_after_s)

    # -- one lease: prepare inputs → resume state → train → upload → keep state -------------------------------

    def _work(self, lease: LeasePublic) -> LeaseResult:
        assert self._heartbeat is not None
        self._heartbeat.watch(lease.lease_id)
        try:
            return self._train_and_upload(lease)
        finally:
            self._heartbeat.watch(None)

    def _train_and_upload(self, lease: LeasePublic) -> LeaseResult:
        t_fetch = time.perf_counter()
        inputs = self._prepare(lease)
        model, optimizer = self._resume(lease, inputs)
        rebase = None
        if inputs.pending:
            rebase = _Rebase(
                self._fetcher.submit(self._landed_weights, lease, inputs), inputs, wait_s=self._overlap_wait_s(lease)
            )
        result = _result(
            lease,
            "uploaded",
            tokens=lease.inner_steps * inputs.inner.batch_size * inputs.model_cfg.seq_len,
            download_bytes=self._downloaded,
            fetch_s=time.perf_counter() - t_fetch,
        )
        if rebase is None:  # the start weights: the modules' versions the lease was given
            result.heldout_loss = self._score_start(model, inputs)
        torch.manual_seed(lease.seed + self.config.seed_offset)
        batches = batches_from_tokens(
            inputs.tokens, batch_size=inputs.inner.batch_size, seq_len=inputs.model_cfg.seq_len, steps=lease.inner_steps
        )
        elapsed = self._inner_steps(lease, model, optimizer, batches, inputs.inner, result, rebase=rebase)
        if result.status == "stopped":
            self._give_back(lease, inputs.where, result)
            return result
        if rebase is not None:  # the outer gradient is taken against the landed versions; they are scored
            rebase.finish(model, len(result.losses))
            result.landed_wait_s, result.rebased_at = rebase.waited_s, rebase.at
            elapsed -= rebase.waited_first_s  # waiting is not training: tokens/s (and so the next H) leave it out
            scored = build_path(inputs.model_cfg, inputs.base).to(self.device)
            result.heldout_loss = self._score_start(scored, inputs)
        result.train_s = elapsed
        result.tokens_per_s = result.tokens / max(elapsed, 1e-9)
        rows = touched_rows(batches, inputs.model_cfg.vocab_size) if lease.sparse_rows else None
        contribution, residual, ends = self._upload(lease, inputs, model, rows=rows, result=result)
        self._ask_early(contribution.next_lease)
        # The inner state and the codec's residual are kept only once the coordinator has accepted the work.
        key = (lease.run_id, lease.path_id)
        self._inner_states.accept(key, lease.lease_id, optimizer.state_dict())
        if residual:
            self._residuals.accept(key, lease.lease_id, residual)
        nxt = contribution.next_lease
        through = nxt is not None and any(m.weights_hash is None for m in nxt.modules)
        self._ends = _EndWeights(lease.run_id, lease.path_id, ends) if through else None  # only the lease using them
        log.info(
            "round %d path %d: loss %.4f→%.4f%s, %.0f tok/s, upload %.2f MB%s%s",
            lease.round,
            lease.path_index,
            result.losses[0],
            result.losses[-1],
            "" if result.heldout_loss is None else f" (held-out at start {result.heldout_loss:.4f})",
            result.tokens_per_s,
            result.upload_bytes / 1e6,
            " (completed the round)" if contribution.round_applied else "",
            _overlap_note(result),
        )
        return result

    def _overlap_wait_s(self, lease: LeasePublic) -> float:
        """How long an overlap lease waits before its first step for its versions: `overlap_wait` of its expected
        training time, from the island's last trained lease (the one whose upload brought this lease)."""
        last = next((r for r in reversed(self.results) if r.losses and r.train_s > 0), None)
        if last is None:
            return 0.0
        return self.config.overlap_wait * last.train_s / len(last.losses) * lease.inner_steps

    @property
    def _overlaps(self) -> bool:
        """Whether this island takes overlap leases (run field `overlap`): single-process islands (the followers of
        a multi-process one would have to rebase in step with rank 0)."""
        return not self.ranks.distributed

    def _score_start(self, model: PathModel, inputs: _Inputs) -> float | None:
        """The held-out loss of the lease's start weights (None when the run keeps no slice or it is too short)."""
        if inputs.heldout is None:
            return None
        try:
            return heldout_loss(model, inputs.heldout, max_tokens=inputs.heldout.numel(), device=self.device)
        except ValueError as exc:  # too short to score: train anyway, report no held-out loss
            log.warning("%s: held-out slice not scored: %s", inputs.where, exc)
            return None

    def _landed(self, lease: LeasePublic, where: str) -> list[LeaseModule]:
        """An overlap lease's modules once every one of their versions has landed (long polling); raises
        `LeaseLost` when the lease is gone, `IslandError` when the coordinator answers other versions."""
        assert self._heartbeat is not None
        while True:
            got = self.client.lease_modules(lease.lease_id, wait_s=LANDED_WAIT_S)
            if got.ready:
                break
            if self._stop.is_set() or self._heartbeat.lease_lost:
                raise LeaseLost(lease.lease_id, "gone while its module versions were pending")
        wanted = {m.module_id: m.version for m in lease.modules}
        if {m.module_id: m.version for m in got.modules} != wanted:
            raise IslandError(f"{where}: the coordinator answered other module versions than the lease's {wanted}")
        return sorted(got.modules, key=lambda m: m.level)

    def _landed_weights(self, lease: LeasePublic, inputs: _Inputs) -> dict[int, dict[str, torch.Tensor]]:
        """The weights of an overlap lease's pending versions once they land, by index in `inputs.levels` (on the
        fetch thread)."""
        landed = {m.module_id: m for m in self._landed(lease, inputs.where)}
        modules = [landed[inputs.levels[i].module_id] for i in inputs.pending]
        # side by side: each is a request and a cache write, and the lease waits for the last
        fetched = self._landed_modules.map(lambda m: self._module_weights(m, inputs.where), modules)
        return dict(zip(inputs.pending, fetched, strict=True))

    def _prepare(self, lease: LeasePublic) -> _Inputs:
        """Check the lease's configs, get its module weights and token range (cache or network). An overlap lease's
        pending modules start from this island's end weights of the path (`_Rebase`), or, where it kept none (a
        restart, another path), from their versions once landed."""
        assert self._heartbeat is not None
        where = f"lease {lease.lease_id} (run {lease.run_id}, round {lease.round}, path {lease.path_index})"
        try:
            model_cfg = ModelConfig.from_dict(lease.model)
            inner = InnerConfig(**lease.inner)
        except (TypeError, ValueError) as exc:
            raise IslandError(f"{where}: bad model or inner config: {exc}") from exc
        self._downloaded = 0
        levels = sorted(lease.modules, key=lambda m: m.level)
        pending = [i for i, m in enumerate(levels) if m.weights_hash is None]
        ends = self._ends
        if pending and (
            ends is None
            or (ends.run_id, ends.path_id) != (lease.run_id, lease.path_id)
            or any(levels[i].module_id not in ends.modules for i in pending)
        ):
            log.info("%s: no end weights of this path kept here; waiting for its module versions", where)
            levels, pending, ends = self._landed(lease, where), [], None
        base = [
            ends.modules[m.module_id] if ends is not None and i in pending else self._module_weights(m, where)
            for i, m in enumerate(levels)
        ]
        tokens = self._tokens(lease, model_cfg, inner, where)
        heldout = self._heldout(lease)
        if self._heartbeat.lease_lost:
            raise LeaseLost(lease.lease_id, "heartbeat reply no longer lists it")
        return _Inputs(
            where=where,
            model_cfg=model_cfg,
            inner=inner,
            levels=levels,
            base=base,
            tokens=tokens,
            heldout=heldout,
            pending=pending,
        )

    def _resume(self, lease: LeasePublic, inputs: _Inputs) -> tuple[PathModel, torch.optim.Optimizer]:
        """Compose the path from its base weights and give it the inner AdamW state kept for (run, path), if any;
        on a multi-process island, announce the lease (and whether to resume) to the followers."""
        try:
            model = build_path(inputs.model_cfg, inputs.base).to(self.device)
        except (RuntimeError, ValueError) as exc:
            raise IslandError(f"{inputs.where}: module weights do not compose a path: {exc}") from exc
        optimizer = make_optimizer(model, inputs.inner)
        saved = self._inner_states.get((lease.run_id, lease.path_id))
        if saved is not None:
            optimizer.load_state_dict(saved)
        if self._leader is not None:
            try:
                self.ranks.rows(inputs.inner.batch_size)
            except ValueError as exc:
                raise IslandError(f"{inputs.where}: {exc}") from exc
            self._leader.announce(
                lease, inputs.tokens, resume=saved is not None, accepted_lease=self._inner_states.last_lease
            )
        return model, optimizer

    def _inner_steps(
        self,
        lease: LeasePublic,
        model: PathModel,
        optimizer: torch.optim.Optimizer,
        batches: list[tuple[torch.Tensor, torch.Tensor]],
        inner: InnerConfig,
        result: LeaseResult,
        *,
        rebase: _Rebase | None = None,
    ) -> float:
        """Run the H inner steps (stop / lost checks before each); returns seconds spent training.

        Raises `LeaseLost` when the heartbeat says the lease is gone; sets `result.status = "stopped"` on a stop
        request. Losses land in `result.losses`.
        """
        heartbeat = self._heartbeat
        assert heartbeat is not None
        lost = False

        def before_step(i: int) -> bool:
            nonlocal lost
            if self._stall is not None:
                self._stall.maybe_stall(lease_id=lease.lease_id, round=lease.round, step=i, stop=self._stop)
            if rebase is not None and i == 0:
                rebase.wait_first(lambda: self._stop.is_set() or heartbeat.lease_lost)
            if self._stop.is_set():
                result.status = "stopped"
                return False
            if heartbeat.lease_lost:
                lost = True
                return False
            if rebase is not None:
                rebase.maybe(model, i)
            return True

        progress = LeaseProgress(
            self.console,
            round=lease.round,
            path_index=lease.path_index,
            steps=len(batches),
            tokens_per_step=inner.batch_size * model.cfg.seq_len,
            quiet=self.config.quiet,
        )
        with progress:
            t0 = time.perf_counter()
            result.losses = inner_phase(
                model,
                optimizer,
                batches,
                inner,
                first_step=lease.first_step,
                device=self.device,
                ranks=self.ranks,
                before_step=before_step,
                after_step=progress.step,
            )
            elapsed = time.perf_counter() - t0
        if lost:
            self._check_fatal()
            raise LeaseLost(lease.lease_id, "heartbeat reply no longer lists it")
        return elapsed

    def _give_back(self, lease: LeasePublic, where: str, result: LeaseResult) -> None:
        """A stop request came during the inner steps: release the lease at once (its path goes back to the pool)."""
        self.client.release(lease.lease_id, give_up_after_s=self._cleanup_budget_s())
        log.info("released %s after %d of %d steps", where, len(result.losses), lease.inner_steps)
        self._lease = None

    def _upload(
        self,
        lease: LeasePublic,
        inputs: _Inputs,
        model: PathModel,
        *,
        rows: torch.Tensor | None,
        result: LeaseResult,
    ) -> tuple[ContributionPublic, dict[str, torch.Tensor], dict[int, dict[str, torch.Tensor]]]:
        """Encode the per-module outer gradients with the run's codec and upload them; raises `LeaseLost` on 409.
        With `rows` (sparse rows) the embedding goes as those rows only.

        Returns the contribution and the codec's new error-feedback residual (what quantisation lost this time,
        and with sparse rows what the rows not sent did, added to the next lease's outer gradient of the path),
        for the caller to keep once the work is accepted; and the trained weights per module id (`_EndWeights`).
        """
        t_upload = time.perf_counter()
        feedback = ErrorFeedback()
        lossy = lease.codec != "fp32" or rows is not None  # fp32 of every row loses nothing: no residual to carry
        if lossy:
            feedback.residual = self._residuals.get((lease.run_id, lease.path_id)) or {}
        trained = {name: t.detach().float().cpu() for name, t in model.state_dict().items()}
        ends = {
            m.module_id: {name: trained[name] for name in w} for m, w in zip(inputs.levels, inputs.base, strict=True)
        }
        grads = _outer_gradients(inputs.levels, inputs.base, ends)
        sparse = {f"{SPARSE_LEVEL}{GRAD_KEY_SEP}{SPARSE_PARAM}": rows} if rows is not None else None
        payload = encode_grad(grads, lease.codec, error_feedback=feedback if lossy else None, rows=sparse)
        result.upload_bytes = len(payload)
        mean_loss = sum(result.losses) / len(result.losses)
        send = self.client.upload_direct if lease.direct_upload else self.client.upload  # bucket, or coordinator
        contribution = send(
            lease,
            payload,
            tokens=result.tokens,
            train_loss=mean_loss,
            heldout_loss=result.heldout_loss,
            rebased_at=result.rebased_at,
            next_lease=self._wants_more(),  # the reply may carry it: no request, no gap before the next lease
            overlap=self._overlaps,
        )
        result.upload_s = time.perf_counter() - t_upload
        return contribution, feedback.residual, ends

    # -- inputs ----------------------------------------------------------------------------------------------

    def _count_download(self, size: int) -> None:
        with self._downloaded_lock:
            self._downloaded += size

    def _module_weights(self, module: LeaseModule, where: str) -> dict[str, torch.Tensor]:
        digest = module.weights_hash
        if digest is None:
            raise IslandError(f"{where}: module {module.module_id} v{module.version} has no weights yet")

        def fetch() -> bytes:
            data = self.client.module_weights(module.module_id, module.version, module.weights_hash, url=module.url)
            self._count_download(len(data))
            return data

        data = self.cache.get_or_fetch(digest, _retry_integrity_once(fetch))
        try:
            return decode(data)
        except CodecError as exc:
            raise IslandError(f"{where}: weights of module {module.module_id} v{module.version}: {exc}") from exc

    def _heldout(self, lease: LeasePublic) -> torch.Tensor | None:
        """The first `score_tokens` of the path's held-out slice (cache or network), when the lease has one."""
        heldout = lease.heldout
        if heldout is None:
            return None

        def fetch() -> bytes:
            data = self.client.heldout_tokens(heldout.shard_id, heldout.tokens_hash, url=heldout.url)
            self._count_download(len(data))
            return data

        tokens = self.cache.tokens(heldout.tokens_hash, _retry_integrity_once(fetch))
        return torch.from_numpy(tokens[: heldout.score_tokens].astype("int64"))

    def _tokens(self, lease: LeasePublic, model_cfg: ModelConfig, inner: InnerConfig, where: str) -> torch.Tensor:
        shard = lease.shard

        def fetch() -> bytes:
            data = self.client.shard_tokens(shard.shard_id, shard.tokens_hash, url=shard.url)
            self._count_download(len(data))
            return data

        tokens = self.cache.tokens(shard.tokens_hash, _retry_integrity_once(fetch))
        need = lease.inner_steps * inner.batch_size * model_cfg.seq_len + 1
        if not 0 <= lease.token_start < lease.token_end <= len(tokens):
            raise IslandError(
                f"{where}: token range [{lease.token_start}, {lease.token_end}) is outside shard "
                f"{shard.shard_id} of {len(tokens)} tokens"
            )
        if lease.token_end - lease.token_start < need:
            raise IslandError(
                f"{where}: token range has {lease.token_end - lease.token_start} tokens, "
                f"{lease.inner_steps} steps need {need}"
            )
        return torch.from_numpy(tokens[lease.token_start : lease.token_end].astype("int64"))


def _result(lease: LeasePublic, status: Literal["uploaded", "lost", "stopped"], **fields: Any) -> LeaseResult:
    return LeaseResult(lease_id=lease.lease_id, round=lease.round, path_index=lease.path_index, status=status, **fields)


def _outer_gradients(
    levels: list[LeaseModule], base: list[dict[str, torch.Tensor]], trained: dict[int, dict[str, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    """Per-module base − trained, named f"{level_name}/{param_name}" (the upload contract)."""
    grads: dict[str, torch.Tensor] = {}
    for module, weights in zip(levels, base, strict=True):
        outer = pseudo_gradient(weights, trained[module.module_id])
        grads.update({f"{module.level_name}{GRAD_KEY_SEP}{name}": t for name, t in outer.items()})
    return grads


def _overlap_note(result: LeaseResult) -> str:
    """For the log line of an overlap lease: when it moved onto the landed versions, and how long it waited for
    them, before its first step and after its last (`OVERLAP_WAIT`; bench/bench_async.py counts that as idle)."""
    if result.rebased_at is None:
        return ""
    return f", rebased before step {result.rebased_at} ({OVERLAP_WAIT} {result.landed_wait_s or 0.0:.3f} s)"


OVERLAP_WAIT = "waited for them"
"""The words before the seconds an overlap lease waited for its versions, in its log line."""


def _retry_integrity_once(fetch: Callable[[], bytes]) -> Callable[[], bytes]:
    """A download that failed its hash check is fetched once more before the island gives up."""

    def fetch_twice() -> bytes:
        try:
            return fetch()
        except IntegrityError as exc:
            log.warning("%s; downloading again", exc)
            return fetch()

    return fetch_twice


def _in_clear(url: str) -> bool:
    """An http:// URL to another machine (loopback traffic stays on this one)."""
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme != "http":
        return False
    host = parsed.hostname or ""
    if host == "localhost":
        return False
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:
        return True
