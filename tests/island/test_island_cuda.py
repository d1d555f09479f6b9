"""The island on a CUDA GPU: capabilities, bf16 autocast in the inner phase, and CUDA against CPU training.

Skipped where no GPU is (CI); `bench/gpu_check.sh` runs these, the end-to-end tests with CUDA islands, and
`bench/bench_island.py --device cuda` on a GPU machine (docs/LOG.md has the results)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from island.capabilities import capabilities, resolve_device
from island.errors import IslandError
from island.inner import inner_phase
from modules import InnerConfig, ModelConfig, batches_from_tokens, build_path, flavour, init_state, make_optimizer
from modules.outer import pseudo_gradient

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (bench/gpu_check.sh runs these on a GPU machine)"
)

CUDA = torch.device("cuda")
TEXT = (Path(__file__).parents[2] / "docs" / "DESIGN.md").read_bytes()  # real English text, byte tokens


def _batches(cfg: ModelConfig, steps: int, batch_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    need = steps * batch_size * cfg.seq_len + 1
    tokens = torch.frombuffer(bytearray(TEXT * (need // len(TEXT) + 1)), dtype=torch.uint8)[:need].long()
    return batches_from_tokens(tokens, batch_size=batch_size, seq_len=cfg.seq_len, steps=steps)


def test_capabilities_report_the_gpu_memory_and_a_bf16_probe() -> None:
    caps = capabilities(CUDA)
    assert caps.device.startswith("cuda")
    assert caps.memory_bytes == torch.cuda.get_device_properties(CUDA).total_memory
    assert caps.tokens_per_s is not None and caps.tokens_per_s > 0


def test_a_gpu_index_beyond_the_machines_gpus_is_refused_by_name() -> None:
    count = torch.cuda.device_count()
    assert resolve_device(f"cuda:{count - 1}") == torch.device("cuda", count - 1)
    with pytest.raises(IslandError, match=f"this machine has {count} GPU"):
        resolve_device(f"cuda:{count}")


def test_the_inner_phase_on_cuda_runs_the_forward_in_bf16_and_keeps_fp32_weights_grads_and_state() -> None:
    cfg = flavour("small")
    inner = InnerConfig(warmup_steps=5, total_steps=60, batch_size=8)
    model = build_path(cfg, [init_state(cfg, seed=0)]).to(CUDA)
    start = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    seen: list[torch.dtype] = []
    linear = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))
    linear.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    optimizer = make_optimizer(model, inner)
    losses = inner_phase(model, optimizer, _batches(cfg, 60, 8), inner, first_step=0, device=CUDA)
    assert len(losses) == 60 and all(math.isfinite(x) for x in losses)
    assert set(seen) == {torch.bfloat16}, seen
    assert sum(losses[-10:]) / 10 < sum(losses[:10]) / 10 - 1.0, losses  # it learns the text
    assert all(p.dtype == torch.float32 and p.device.type == "cuda" for p in model.parameters())
    assert all(p.grad is None or p.grad.dtype == torch.float32 for p in model.parameters())
    for state in optimizer.state.values():
        assert state["exp_avg"].dtype == torch.float32 and state["exp_avg_sq"].dtype == torch.float32
    trained = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    outer = pseudo_gradient(start, trained)
    assert all(t.dtype == torch.float32 and bool(torch.isfinite(t).all()) for t in outer.values())
    assert any(float(t.abs().max()) > 0 for t in outer.values())


def test_bf16_loss_is_within_one_percent_of_fp32_on_the_same_weights() -> None:
    cfg = flavour("small")
    model = build_path(cfg, [init_state(cfg, seed=1)]).to(CUDA).eval()
    x, y = (t.to(CUDA) for t in _batches(cfg, 1, 8)[0])
    with torch.no_grad():
        fp32 = float(model.loss(x, y))
        with torch.autocast("cuda", dtype=torch.bfloat16):
            bf16 = float(model.loss(x, y))
    assert abs(bf16 - fp32) / fp32 < 0.01, (bf16, fp32)


def test_cuda_and_cpu_take_the_same_inner_steps_within_bf16_tolerance() -> None:
    """Five AdamW steps from the same weights on the same batches: the weight change on CUDA (bf16 forward) is
    the CPU's (fp32) within 10 % of its norm: device placement and precision lose nothing that matters (AdamW's
    first steps are close to lr * sign(g), so bf16 rounding flips the sign of some near-zero gradients)."""
    cfg = flavour("debug")
    inner = InnerConfig(warmup_steps=1, total_steps=5, batch_size=8)
    batches = _batches(cfg, 5, 8)
    start = init_state(cfg, seed=3)
    deltas = []
    for device in (torch.device("cpu"), CUDA):
        model = build_path(cfg, [start]).to(device)
        inner_phase(model, make_optimizer(model, inner), batches, inner, first_step=0, device=device)
        trained = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
        deltas.append(torch.cat([(start[k] - trained[k]).flatten() for k in sorted(start)]))
    cpu, gpu = deltas
    apart = float((gpu - cpu).norm() / cpu.norm())
    print(f"CUDA vs CPU weight change after 5 steps: {apart:.4f} of its norm")
    assert apart < 0.1, apart
