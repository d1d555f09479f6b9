"""The two block styles of the path model (gpt2, llama), the SwiGLU width rule and tied embeddings."""

from __future__ import annotations

import math

import pytest
import torch

from modules import (
    FLAVOURS,
    ModelConfig,
    PathModel,
    build_path,
    flavour,
    init_level_modules,
    init_state,
    level_param_shapes,
    parse_layout,
    split_state,
)
from modules.model import RMSNorm, apply_rotary, rotary_tables

DEBUG = flavour("debug").to_dict()
GPT2 = ModelConfig.from_dict({**DEBUG, "block": "gpt2"})
LLAMA = ModelConfig.from_dict({**DEBUG, "block": "llama"})
LAYOUT = parse_layout("embed:shared, b0-0:routed2, b1-1:routed2, head:shared", n_layers=2)
BOTH = pytest.mark.parametrize("cfg", [GPT2, LLAMA], ids=["gpt2", "llama"])


def count(cfg: ModelConfig) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in PathModel(cfg).parameters())


def test_llama_debug_path_matches_gpt2_parameters() -> None:
    # the controlled experiment: SwiGLU width 185, 137,024 vs 137,088 parameters
    assert LLAMA.mlp_hidden == 185 and GPT2.mlp_hidden == 256
    assert (count(LLAMA), count(GPT2)) == (137_024, 137_088)


@pytest.mark.parametrize("name", sorted(FLAVOURS))
@pytest.mark.parametrize("tie", [False, True])
def test_width_rule_is_the_closest_integer_width(name: str, tie: bool) -> None:
    base = {**flavour(name).to_dict(), "tie_embeddings": tie}
    gpt2 = count(ModelConfig.from_dict({**base, "block": "gpt2"}))
    llama = ModelConfig.from_dict({**base, "block": "llama"})
    n = count(llama)
    per_unit = 3 * llama.d_model * llama.n_layers  # parameters one more SwiGLU unit adds to a path
    assert abs(n - gpt2) <= per_unit / 2  # no other integer width comes closer
    assert abs(n - gpt2) / gpt2 < 1e-3


def test_width_rule_formula() -> None:
    for d, t, layers, m in [(64, 64, 2, 4), (128, 128, 4, 4), (896, 1024, 12, 4), (48, 32, 3, 2), (32, 16, 1, 8)]:
        cfg = ModelConfig(d_model=d, seq_len=t, n_layers=layers, n_heads=4, mlp_ratio=m, block="llama")
        assert cfg.mlp_hidden == round(2 / 3 * m * d + (t + (7 + m) * layers + 1) / (3 * layers))


def test_llama_names_and_level_split() -> None:
    state = init_state(LLAMA, seed=0)
    parts = split_state(state, LAYOUT)
    assert set(parts[0]) == {"tok_emb.weight"}  # no learned positions
    assert set(parts[3]) == {"ln_f.weight", "lm_head.weight"}  # RMSNorm: no bias
    assert set(parts[1]) == {
        f"blocks.0.{n}.weight" for n in ("ln1", "attn.qkv", "attn.proj", "ln2", "mlp.fc", "mlp.proj")
    }
    assert not [n for n in state if n.endswith(".bias")]
    for i, part in enumerate(parts):
        assert level_param_shapes(LLAMA, LAYOUT, i) == {n: tuple(t.shape) for n, t in part.items()}
    assert state["blocks.0.mlp.fc.weight"].shape == (2 * 185, 64)  # gate and up, fused
    assert state["blocks.0.mlp.proj.weight"].shape == (64, 185)
    assert torch.equal(state["blocks.1.ln2.weight"], torch.ones(64))
    assert torch.equal(state["ln_f.weight"], torch.ones(64))
    assert abs(float(state["blocks.0.mlp.fc.weight"].std()) - 0.02) < 0.002


@BOTH
def test_tied_embeddings_live_in_the_embed_level(cfg: ModelConfig) -> None:
    tied = ModelConfig.from_dict({**cfg.to_dict(), "tie_embeddings": True})
    parts = split_state(init_state(tied, seed=0), LAYOUT)
    assert "tok_emb.weight" in parts[0]
    assert set(parts[3]) == ({"ln_f.weight", "ln_f.bias"} if cfg.block == "gpt2" else {"ln_f.weight"})
    assert count(cfg) - count(tied) == cfg.vocab_size * cfg.d_model
    model = build_path(tied, init_level_modules(tied, LAYOUT, seed=0))
    x = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(model(x), model.hidden(x) @ model.tok_emb.weight.T)
    # the output side trains the embedding too: a token that is only ever a target still gets a gradient
    model.loss(torch.zeros(1, 4, dtype=torch.long), torch.full((1, 4), 200)).backward()
    assert model.tok_emb.weight.grad is not None and model.tok_emb.weight.grad[200].abs().sum() > 0


@BOTH
def test_causal(cfg: ModelConfig) -> None:
    model = build_path(cfg, [init_state(cfg, seed=1)]).eval()
    x = torch.randint(0, 257, (1, 20), generator=torch.Generator().manual_seed(0))
    y = x.clone()
    y[0, 12:] = (y[0, 12:] + 1) % 257
    torch.testing.assert_close(model(x)[:, :12], model(y)[:, :12])
    assert not torch.allclose(model(x)[:, 12:], model(y)[:, 12:])


def test_rms_norm() -> None:
    norm = RMSNorm(8)
    with torch.no_grad():
        norm.weight.copy_(torch.arange(8.0))
    x = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(0))
    want = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * torch.arange(8.0)
    torch.testing.assert_close(norm(x), want)


def test_rotary_angles_and_relative_positions() -> None:
    cos, sin = rotary_tables(8, 6, torch.device("cpu"))
    assert cos.shape == sin.shape == (6, 4)
    # position p turns pair i by p * 10000^(-2i/8)
    assert float(torch.atan2(sin[3, 1], cos[3, 1])) == pytest.approx(3 * 10000 ** (-2 / 8), abs=1e-6)
    assert torch.equal(cos[0], torch.ones(4)) and torch.equal(sin[0], torch.zeros(4))
    # rotations preserve norms, and q . k depends only on the distance between the two positions
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(8, generator=gen), torch.randn(8, generator=gen)
    rope = rotary_tables(8, 64, torch.device("cpu"))
    qs = apply_rotary(q.expand(1, 1, 64, 8), rope)[0, 0]  # q at every position
    ks = apply_rotary(k.expand(1, 1, 64, 8), rope)[0, 0]
    torch.testing.assert_close(qs.norm(dim=-1), q.norm().expand(64))
    for shift in (1, 17, 40):
        torch.testing.assert_close(qs[20] @ ks[5], qs[20 + shift] @ ks[5 + shift], rtol=1e-5, atol=1e-5)


def test_llama_sees_positions_through_rotary_only() -> None:
    # no position table, yet the model is not permutation-invariant: the same token at two positions differs
    model = build_path(LLAMA, [init_state(LLAMA, seed=2)]).eval()
    h = model.hidden(torch.tensor([[5, 9, 5, 9, 5]]))
    assert not torch.allclose(h[0, 1], h[0, 3])


@BOTH
def test_bf16_autocast_forward(cfg: ModelConfig) -> None:
    # the island's CUDA path wraps the forward in bf16 autocast; the CPU autocast exercises the same dtype mix
    model = build_path(cfg, [init_state(cfg, seed=0)])
    x = torch.randint(0, 257, (2, cfg.seq_len), generator=torch.Generator().manual_seed(0))
    ref = model.loss(x, x).detach()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model.loss(x, x)
    loss.backward()
    assert math.isfinite(loss.item()) and abs(loss.item() - ref.item()) < 0.05
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())
