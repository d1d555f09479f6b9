"""The device an island trains on, and the capabilities it reports on join: device, memory, and training tokens/s
measured by a short probe.

The coordinator may use them to pick paths that fit and to size H per island (heterogeneous islands).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time

import torch

from coordinator.schemas import IslandCapabilities
from island.errors import IslandError
from island.inner import inner_phase
from modules import InnerConfig, batches_from_tokens, build_path, flavour, init_state, make_optimizer

log = logging.getLogger(__name__)

PROBE_WARMUP_STEPS = 1
"""Untimed step first: it pays for lazy initialisation (allocator, kernels, thread pools)."""
PROBE_BUDGET_S = 0.3
"""Timed steps run until this much time has passed (at most `PROBE_MAX_STEPS`)."""
PROBE_MAX_STEPS = 20


def resolve_device(name: str) -> torch.device:
    """The torch device for `--device`: "auto" is cuda when available, else cpu; cuda without CUDA, or cuda:N
    beyond the machine's GPUs, is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise IslandError(f"device {name!r} requested but CUDA is not available; use --device cpu")
    if device.type == "cuda" and device.index is not None and device.index >= (count := torch.cuda.device_count()):
        raise IslandError(f"device {name!r} requested but this machine has {count} GPU(s): cuda:0..cuda:{count - 1}")
    return device


def probe_tokens_per_s(device: torch.device, *, batch_size: int = 8) -> float:
    """Training tokens/s of the `debug` flavour on `device` (AdamW steps on random tokens, < 1 s once warm)."""
    cfg = flavour("debug")
    model = build_path(cfg, [init_state(cfg, seed=0)]).to(device)
    steps = PROBE_WARMUP_STEPS + PROBE_MAX_STEPS
    inner = InnerConfig(warmup_steps=0, total_steps=steps, batch_size=batch_size)
    optimizer = make_optimizer(model, inner)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (steps * batch_size * cfg.seq_len + 1,), generator=gen)
    batches = batches_from_tokens(tokens, batch_size=batch_size, seq_len=cfg.seq_len, steps=steps)
    inner_phase(model, optimizer, batches[:PROBE_WARMUP_STEPS], inner, first_step=0, device=device)
    t0 = time.perf_counter()

    def within_budget(i: int) -> bool:
        return time.perf_counter() - t0 < PROBE_BUDGET_S

    # inner_phase returns Python floats, so the device is synchronised when it returns.
    done = inner_phase(
        model,
        optimizer,
        batches[PROBE_WARMUP_STEPS:],
        inner,
        first_step=PROBE_WARMUP_STEPS,
        device=device,
        before_step=within_budget,
    )
    return len(done) * batch_size * cfg.seq_len / max(time.perf_counter() - t0, 1e-9)


def capabilities(device: torch.device, *, probe: bool = True) -> IslandCapabilities:
    """Device, memory (GPU memory on CUDA, physical RAM otherwise) and, with `probe`, measured tokens/s."""
    memory: int | None = None
    if device.type == "cuda":
        memory = int(torch.cuda.get_device_properties(device).total_memory)
    else:
        with contextlib.suppress(ValueError, OSError, AttributeError):
            memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    tokens_per_s: float | None = None
    if probe:
        try:
            tokens_per_s = round(probe_tokens_per_s(device), 1)
        except RuntimeError as exc:  # e.g. out of memory: join anyway, without a speed
            log.warning("capabilities probe failed: %s", exc)
    return IslandCapabilities(device=str(device), memory_bytes=memory, tokens_per_s=tokens_per_s)
