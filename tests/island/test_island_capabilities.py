"""Capabilities reported on join (device, memory, probed tokens/s), the new CLI flags, and the fault-injection knob."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from typer.main import get_command

from island.capabilities import PROBE_BUDGET_S, capabilities
from island.cli import app
from island.faults import STALL_ENV, Stall


def test_capabilities_probe_measures_tokens_per_s_quickly() -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 2 OpenMP threads on a loaded 2-core box spin-wait each other into a 50x slowdown
    try:
        capabilities(torch.device("cpu"))  # the first call pays torch's lazy initialisation
        t0 = time.perf_counter()
        caps = capabilities(torch.device("cpu"))
        took = time.perf_counter() - t0
    finally:
        torch.set_num_threads(threads)
    assert caps.device == "cpu"
    assert caps.memory_bytes is not None and caps.memory_bytes > 1 << 20
    assert caps.tokens_per_s is not None and caps.tokens_per_s > 0
    assert took < 1.0 + PROBE_BUDGET_S


def test_capabilities_without_probe_have_no_speed() -> None:
    caps = capabilities(torch.device("cpu"), probe=False)
    assert caps.tokens_per_s is None and caps.memory_bytes


def test_join_has_the_multi_process_retry_and_probe_flags() -> None:
    join = get_command(app).commands["join"]  # type: ignore[attr-defined]
    options = {opt for param in join.params for opt in (*param.opts, *param.secondary_opts)}
    assert {"--nproc", "--max-backoff", "--probe", "--no-probe"} <= options
    envvars = {param.name: param.envvar for param in join.params}
    assert envvars["nproc"] == "DIPACO_ISLAND_NPROC"
    assert envvars["cache_dir"] == "DIPACO_ISLAND_CACHE_DIR"


def test_stall_fault_is_parsed_from_the_environment_and_fires_once_per_matching_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(STALL_ENV, raising=False)
    assert Stall.from_env() is None
    monkeypatch.setenv(STALL_ENV, "1:2:0.2")
    stall = Stall.from_env()
    assert stall == Stall(round=1, step=2, seconds=0.2)
    stop = threading.Event()
    t0 = time.perf_counter()
    stall.maybe_stall(lease_id=1, round=0, step=2, stop=stop)
    stall.maybe_stall(lease_id=1, round=1, step=1, stop=stop)
    assert time.perf_counter() - t0 < 0.1
    stall.maybe_stall(lease_id=1, round=1, step=2, stop=stop)
    assert time.perf_counter() - t0 >= 0.2
    monkeypatch.setenv(STALL_ENV, "*:1:0.1")
    every = Stall.from_env()
    assert every == Stall(round=None, step=1, seconds=0.1)
    t0 = time.perf_counter()
    every.maybe_stall(lease_id=2, round=0, step=2, stop=stop)
    assert time.perf_counter() - t0 < 0.1
    every.maybe_stall(lease_id=2, round=0, step=1, stop=stop)
    every.maybe_stall(lease_id=3, round=7, step=1, stop=stop)
    assert time.perf_counter() - t0 >= 0.2
    monkeypatch.setenv(STALL_ENV, "nonsense")
    with pytest.raises(ValueError, match="ROUND:STEP:SECONDS"):
        Stall.from_env()
