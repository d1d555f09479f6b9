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
import logging
import math
import os
import signal
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, Literal

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from coordinator.schemas import GRAD_KEY_SEP, LeaseModule, LeasePublic
from island.cache import BlobCache
from island.capabilities import capabilities
from island.client import CoordinatorClient, RetryPolicy
from island.distributed import Leader, init_group, rank_device
from island.errors import CoordinatorUnavailable, IntegrityError, IslandError, LeaseLost
from island.faults import Stall
from island.heartbeat import Heartbeater
from island.inner import Ranks, inner_phase
from modules import (
    CodecError,
    InnerConfig,
    ModelConfig,
    PathModel,
    batches_from_tokens,
    build_path,
    decode,
    encode,
    make_optimizer,
    pseudo_gradient,
)

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


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise IslandError(f"device {name!r} requested but CUDA is not available; use --device cpu")
    return device


def _cpu_copy(obj: Any) -> Any:
    """Deep copy of an optimizer state dict with every tensor cloned to CPU (keeps GPU memory free)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_cpu_copy(v) for v in obj]
    return obj


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
        self.client = client if client is not None else CoordinatorClient(config.coordinator, config.token, retry=retry)
        self.console = console if console is not None else Console(stderr=True)
        self.cache = BlobCache(config.cache_dir)
        self.results: list[LeaseResult] = []
        self._stop = threading.Event()
        self._signum: int | None = None
        self._heartbeat: Heartbeater | None = None
        self._joined = False
        self._lease: LeasePublic | None = None
        """The lease being worked on; released on the way out if still set."""
        self._opt_key: tuple[int, int] | None = None
        self._opt_state: dict[str, Any] | None = None
        """AdamW state after the last accepted lease, kept for the next lease of the same (run, path)."""
        self._opt_states: OrderedDict[tuple[int, int], dict[str, Any]] = OrderedDict()
        """Single-process islands: AdamW state per (run, path), least recently trained first."""
        self._opt_lease: int | None = None
        """The lease `_opt_state` belongs to (multi-process islands: followers keep their own copy)."""
        self._leader: Leader | None = None
        self._stall = Stall.from_env()
        self._downloaded = 0
        """Bytes downloaded for the lease being prepared."""
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
            except IslandError as exc:
                log.error("%s", exc)
                code = EXIT_ERROR
            except Exception:
                log.exception("island crashed")
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
            lease = self.client.lease(wait_s=cfg.lease_wait_s)
            if lease is not None and self._stop.is_set():  # stopped while the request was held: give it back
                self._lease = lease
                self.results.append(
                    LeaseResult(
                        lease_id=lease.lease_id, round=lease.round, path_index=lease.path_index, status="stopped"
                    )
                )
                break
            if lease is None:
                idle = self.client.idle
                assert idle is not None
                if idle.reason == "no-running-runs" and (self.rounds_done > 0 or cfg.exit_when_idle):
                    log.info("no run is running; leaving after %d lease(s)", self.rounds_done)
                    return EXIT_OK
                log.debug("no work (%s); asking again in %.1fs", idle.reason, idle.retry_after_s)
                if self._leader is not None:
                    self._leader.keepalive()
                self._stop.wait(idle.retry_after_s)
                continue
            self._lease = lease
            try:
                self.results.append(self._work(lease))
            except LeaseLost as exc:
                log.warning("%s; discarding its work and asking for new work", exc)
                self.results.append(
                    LeaseResult(lease_id=lease.lease_id, round=lease.round, path_index=lease.path_index, status="lost")
                )
            self._lease = None
        return EXIT_OK

    def _check_fatal(self) -> None:
        if self._heartbeat is not None and self._heartbeat.fatal is not None:
            raise self._heartbeat.fatal

    def _shutdown(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop()
        budget = min(CLEANUP_GIVE_UP_S, self.config.give_up_after_s)
        if self._lease is not None:
            with contextlib.suppress(IslandError):
                self.client.release(self._lease.lease_id, give_up_after_s=budget)
                log.info("released lease %d", self._lease.lease_id)
            self._lease = None
        if self._joined:
            with contextlib.suppress(IslandError):
                self.client.leave(give_up_after_s=budget)
            self._joined = False
        if self._leader is not None:
            with contextlib.suppress(RuntimeError):  # a follower already gone: nothing left to stop
                self._leader.stop()
            self._leader = None
        self.client.close()

    # -- one lease -----------------------------------------------------------------------------------------

    def _work(self, lease: LeasePublic) -> LeaseResult:
        assert self._heartbeat is not None
        self._heartbeat.watch(lease.lease_id)
        try:
            return self._train_and_upload(lease)
        finally:
            self._heartbeat.watch(None)

    def _train_and_upload(self, lease: LeasePublic) -> LeaseResult:
        assert self._heartbeat is not None
        heartbeat = self._heartbeat
        where = f"lease {lease.lease_id} (run {lease.run_id}, round {lease.round}, path {lease.path_index})"
        try:
            model_cfg = ModelConfig.from_dict(lease.model)
            inner = InnerConfig(**lease.inner)
        except (TypeError, ValueError) as exc:
            raise IslandError(f"{where}: bad model or inner config: {exc}") from exc
        t_fetch = time.perf_counter()
        self._downloaded = 0
        levels = sorted(lease.modules, key=lambda m: m.level)
        base = [self._module_weights(m, where) for m in levels]
        tokens = self._tokens(lease, model_cfg, inner, where)
        if heartbeat.lease_lost:
            raise LeaseLost(lease.lease_id, "heartbeat reply no longer lists it")

        try:
            model = build_path(model_cfg, base).to(self.device)
        except (RuntimeError, ValueError) as exc:
            raise IslandError(f"{where}: module weights do not compose a path: {exc}") from exc
        optimizer = make_optimizer(model, inner)
        key = (lease.run_id, lease.path_id)
        if self._leader is None:
            saved = self._opt_states.get(key)
        else:  # followers hold the state of the last accepted lease only
            saved = self._opt_state if self._opt_key == key else None
        resume = saved is not None
        if saved is not None:
            optimizer.load_state_dict(_cpu_copy(saved))
        torch.manual_seed(lease.seed + self.config.seed_offset)
        batches = batches_from_tokens(
            tokens, batch_size=inner.batch_size, seq_len=model_cfg.seq_len, steps=lease.inner_steps
        )
        if self._leader is not None:
            try:
                self.ranks.rows(inner.batch_size)
            except ValueError as exc:
                raise IslandError(f"{where}: {exc}") from exc
            self._leader.announce(lease, tokens, resume=resume, accepted_lease=self._opt_lease)

        result = LeaseResult(
            lease_id=lease.lease_id,
            round=lease.round,
            path_index=lease.path_index,
            status="uploaded",
            tokens=lease.inner_steps * inner.batch_size * model_cfg.seq_len,
            download_bytes=self._downloaded,
            fetch_s=time.perf_counter() - t_fetch,
        )
        elapsed = self._inner_steps(lease, model, optimizer, batches, inner, result)
        if result.status == "stopped":
            self.client.release(lease.lease_id, give_up_after_s=min(CLEANUP_GIVE_UP_S, self.config.give_up_after_s))
            log.info("released %s after %d of %d steps", where, len(result.losses), lease.inner_steps)
            self._lease = None
            return result
        result.tokens_per_s = result.tokens / max(elapsed, 1e-9)
        result.train_s = elapsed
        t_upload = time.perf_counter()

        payload = encode(self._outer_gradients(levels, base, model))
        result.upload_bytes = len(payload)
        mean_loss = sum(result.losses) / len(result.losses)
        contribution = self.client.upload(lease, payload, tokens=result.tokens, train_loss=mean_loss)
        result.upload_s = time.perf_counter() - t_upload
        # The inner state is kept only once the coordinator has accepted the work it belongs to.
        self._opt_key, self._opt_state = key, _cpu_copy(optimizer.state_dict())
        self._opt_lease = lease.lease_id
        if self._leader is None:
            self._opt_states[key] = self._opt_state
            self._opt_states.move_to_end(key)
            while len(self._opt_states) > self.config.optimizer_cache:
                self._opt_states.popitem(last=False)
        log.info(
            "round %d path %d: loss %.4f→%.4f, %.0f tok/s, upload %.2f MB%s",
            lease.round,
            lease.path_index,
            result.losses[0],
            result.losses[-1],
            result.tokens_per_s,
            result.upload_bytes / 1e6,
            " (round applied)" if contribution.round_applied else "",
        )
        return result

    def _inner_steps(
        self,
        lease: LeasePublic,
        model: PathModel,
        optimizer: torch.optim.Optimizer,
        batches: list[tuple[torch.Tensor, torch.Tensor]],
        inner: InnerConfig,
        result: LeaseResult,
    ) -> float:
        """Run the H inner steps (stop / lost checks before each); returns seconds spent training.

        Raises `LeaseLost` when the heartbeat says the lease is gone; sets `result.status = "stopped"` on a stop
        request. Losses land in `result.losses`.
        """
        heartbeat = self._heartbeat
        assert heartbeat is not None
        autocast: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
        if self.device.type == "cuda":
            # bf16 autocast around the forward; parameters and AdamW state stay fp32.
            def autocast() -> contextlib.AbstractContextManager[Any]:
                return torch.autocast("cuda", dtype=torch.bfloat16)

        progress = Progress(
            TextColumn("round {task.fields[round]} path {task.fields[path]}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("{task.fields[tps]} tok/s"),
            TimeElapsedColumn(),
            console=self.console,
            disable=self.config.quiet,
            transient=False,
            refresh_per_second=2,  # the bar redraws from a thread; fewer redraws, less GIL taken from training
        )
        tokens_per_step = inner.batch_size * model.cfg.seq_len
        lost = False
        t0 = time.perf_counter()
        last_shown = 0.0

        def before_step(i: int) -> bool:
            nonlocal lost
            if self._stall is not None:
                self._stall.maybe_stall(lease_id=lease.lease_id, round=lease.round, step=i, stop=self._stop)
            if self._stop.is_set():
                result.status = "stopped"
                return False
            if heartbeat.lease_lost:
                lost = True
                return False
            return True

        def after_step(i: int, loss: torch.Tensor) -> None:
            nonlocal last_shown
            if self.config.quiet:
                return
            now = time.perf_counter()
            # Reading the loss syncs the device: do it at most a few times a second, never every step.
            if now - last_shown < 0.25 and i + 1 < len(batches):
                progress.update(task, advance=1)
                return
            last_shown = now
            value = float(loss)
            progress.update(
                task,
                advance=1,
                loss=f"{value:.4f}" if math.isfinite(value) else str(value),
                tps=f"{tokens_per_step * (i + 1) / max(now - t0, 1e-9):.0f}",
            )

        with progress:
            task = progress.add_task(
                "train", total=len(batches), round=lease.round, path=lease.path_index, loss="-", tps="-"
            )
            t0 = time.perf_counter()
            result.losses = inner_phase(
                model,
                optimizer,
                batches,
                inner,
                first_step=lease.first_step,
                device=self.device,
                ranks=self.ranks,
                autocast=autocast,
                before_step=before_step,
                after_step=after_step,
            )
            elapsed = time.perf_counter() - t0
        if lost:
            self._check_fatal()
            raise LeaseLost(lease.lease_id, "heartbeat reply no longer lists it")
        return elapsed

    @staticmethod
    def _outer_gradients(
        levels: list[LeaseModule], base: list[dict[str, torch.Tensor]], model: PathModel
    ) -> dict[str, torch.Tensor]:
        """Per-module base − trained, named f"{level_name}/{param_name}" (the upload contract)."""
        trained = {name: t.detach().float().cpu() for name, t in model.state_dict().items()}
        grads: dict[str, torch.Tensor] = {}
        for module, weights in zip(levels, base, strict=True):
            outer = pseudo_gradient(weights, {name: trained[name] for name in weights})
            grads.update({f"{module.level_name}{GRAD_KEY_SEP}{name}": t for name, t in outer.items()})
        return grads

    # -- inputs ----------------------------------------------------------------------------------------------

    def _module_weights(self, module: LeaseModule, where: str) -> dict[str, torch.Tensor]:
        def fetch() -> bytes:
            data = self.client.module_weights(module.module_id, module.version, module.weights_hash)
            self._downloaded += len(data)
            return data

        data = self.cache.get_or_fetch(module.weights_hash, _retry_integrity_once(fetch))
        try:
            return decode(data)
        except CodecError as exc:
            raise IslandError(f"{where}: weights of module {module.module_id} v{module.version}: {exc}") from exc

    def _tokens(self, lease: LeasePublic, model_cfg: ModelConfig, inner: InnerConfig, where: str) -> torch.Tensor:
        shard = lease.shard

        def fetch() -> bytes:
            data = self.client.shard_tokens(shard.shard_id, shard.tokens_hash)
            self._downloaded += len(data)
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


def _retry_integrity_once(fetch: Callable[[], bytes]) -> Callable[[], bytes]:
    """A download that failed its hash check is fetched once more before the island gives up."""

    def fetch_twice() -> bytes:
        try:
            return fetch()
        except IntegrityError as exc:
            log.warning("%s; downloading again", exc)
            return fetch()

    return fetch_twice
