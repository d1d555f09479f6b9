"""Training throughput of a path composed with `modules.build_path` vs the same architecture as one plain module.

The plain model below is written independently of `modules/model.py` (one class, no ModuleList of blocks,
fused weights in plain tensors) and loaded with the same weights; a forward check makes sure both compute the
same function before timing. Both run the same batch with AdamW (fwd + bwd + step), interleaved in
repetitions so drift in machine load hits both alike. Reported: median tokens/s of each, and the ratio as
the median over repetitions of composed/plain measured back to back (and best-of: the ratio of the
fastest repetitions, the least disturbed by other load).

    .venv/bin/python bench/bench_compose.py [--flavour small] [--reps 15] [--seconds 1] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from modules import InnerConfig, ModelConfig, build_path, flavour, init_level_modules, make_optimizer, parse_layout


class PlainGPT(nn.Module):
    """Pre-norm decoder, learned positions, causal SDPA, GELU MLP, untied head: everything in one class."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d, L, m = cfg.d_model, cfg.n_layers, cfg.mlp_ratio
        self.n_heads = cfg.n_heads
        self.tok = nn.Parameter(torch.empty(cfg.vocab_size, d))
        self.pos = nn.Parameter(torch.empty(cfg.seq_len, d))
        self.ln1_w, self.ln1_b = nn.Parameter(torch.ones(L, d)), nn.Parameter(torch.zeros(L, d))
        self.ln2_w, self.ln2_b = nn.Parameter(torch.ones(L, d)), nn.Parameter(torch.zeros(L, d))
        self.qkv_w, self.qkv_b = nn.Parameter(torch.empty(L, 3 * d, d)), nn.Parameter(torch.zeros(L, 3 * d))
        self.o_w, self.o_b = nn.Parameter(torch.empty(L, d, d)), nn.Parameter(torch.zeros(L, d))
        self.fc_w, self.fc_b = nn.Parameter(torch.empty(L, m * d, d)), nn.Parameter(torch.zeros(L, m * d))
        self.pr_w, self.pr_b = nn.Parameter(torch.empty(L, d, m * d)), nn.Parameter(torch.zeros(L, d))
        self.lnf_w, self.lnf_b = nn.Parameter(torch.ones(d)), nn.Parameter(torch.zeros(d))
        self.head = nn.Parameter(torch.empty(cfg.vocab_size, d))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        b, t = idx.shape
        d = self.tok.shape[1]
        x = self.tok[idx] + self.pos[:t]
        for i in range(self.qkv_w.shape[0]):
            h = F.layer_norm(x, (d,), self.ln1_w[i], self.ln1_b[i])
            q, k, v = F.linear(h, self.qkv_w[i], self.qkv_b[i]).split(d, dim=2)
            # (B, T, d) -> (B, heads, T, d / heads)
            q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
            x = x + F.linear(a, self.o_w[i], self.o_b[i])
            h = F.layer_norm(x, (d,), self.ln2_w[i], self.ln2_b[i])
            x = x + F.linear(F.gelu(F.linear(h, self.fc_w[i], self.fc_b[i])), self.pr_w[i], self.pr_b[i])
        return F.linear(F.layer_norm(x, (d,), self.lnf_w, self.lnf_b), self.head)

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self(idx)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    @torch.no_grad()
    def load_path_state(self, state: dict[str, torch.Tensor]) -> None:
        self.tok.copy_(state["tok_emb.weight"])
        self.pos.copy_(state["pos_emb.weight"])
        pairs = {
            "ln1_w": "ln1.weight",
            "ln1_b": "ln1.bias",
            "ln2_w": "ln2.weight",
            "ln2_b": "ln2.bias",
            "qkv_w": "attn.qkv.weight",
            "qkv_b": "attn.qkv.bias",
            "o_w": "attn.proj.weight",
            "o_b": "attn.proj.bias",
            "fc_w": "mlp.fc.weight",
            "fc_b": "mlp.fc.bias",
            "pr_w": "mlp.proj.weight",
            "pr_b": "mlp.proj.bias",
        }
        for ours, theirs in pairs.items():
            param = getattr(self, ours)
            for i in range(param.shape[0]):
                param[i].copy_(state[f"blocks.{i}.{theirs}"])
        self.lnf_w.copy_(state["ln_f.weight"])
        self.lnf_b.copy_(state["ln_f.bias"])
        self.head.copy_(state["lm_head.weight"])


def time_steps(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, seconds: float) -> float:
    """Train steps on one batch for about `seconds`; returns tokens/s."""
    steps = 0
    start = time.perf_counter()
    while True:
        opt.zero_grad(set_to_none=True)
        model.loss(x, y).backward()  # type: ignore[operator]
        opt.step()
        steps += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return steps * x.numel() / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavour", default="small")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    # the plain model is a GPT-2 block: compare against the same block whatever the flavour's default is
    cfg = ModelConfig.from_dict({**flavour(args.flavour).to_dict(), "block": "gpt2"})
    half = cfg.n_layers // 2
    layout = parse_layout(
        f"embed:shared, b0-{half - 1}:routed2, b{half}-{cfg.n_layers - 1}:routed2, head:shared",
        n_layers=cfg.n_layers,
    )
    modules = init_level_modules(cfg, layout, seed=0)
    composed = build_path(cfg, modules)
    plain = PlainGPT(cfg)
    plain.load_path_state(composed.state_dict())

    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch_size, cfg.seq_len + 1), generator=gen)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    with torch.no_grad():
        diff = (composed(x) - plain(x)).abs().max().item()
    assert diff < 1e-4, f"the two models disagree by {diff}"

    inner = InnerConfig()
    opt_c = make_optimizer(composed, inner)
    opt_p = torch.optim.AdamW(
        plain.parameters(), lr=inner.lr, betas=(inner.beta1, inner.beta2), weight_decay=inner.weight_decay
    )
    time_steps(composed, opt_c, x, y, 0.5)  # warm-up (allocator, kernels)
    time_steps(plain, opt_p, x, y, 0.5)
    rates_c: list[float] = []
    rates_p: list[float] = []
    for rep in range(args.reps):
        # alternate which goes first, so neither always runs in the other's thermal/load shadow
        order = [(composed, opt_c, rates_c), (plain, opt_p, rates_p)]
        for model, opt, rates in order if rep % 2 == 0 else order[::-1]:
            rates.append(time_steps(model, opt, x, y, args.seconds))
    c, p = statistics.median(rates_c), statistics.median(rates_p)
    # adjacent measurements share the machine's load, so the median of per-repetition ratios is the headline
    paired = statistics.median(rc / rp for rc, rp in zip(rates_c, rates_p, strict=True))
    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, flavour {args.flavour}, "
        f"batch {args.batch_size}x{cfg.seq_len}, {args.reps} reps x {args.seconds}s, max |logit diff| {diff:.1e}"
    )
    print(f"composed (modules.build_path): {c:,.0f} tokens/s  (reps: {', '.join(f'{r:,.0f}' for r in rates_c)})")
    print(f"plain nn.Module:               {p:,.0f} tokens/s  (reps: {', '.join(f'{r:,.0f}' for r in rates_p)})")
    best = max(rates_c) / max(rates_p)
    print(
        f"ratio composed / plain: {paired:.3f} median of paired reps, {best:.3f} best-of, {c / p:.3f} of medians"
        f" (target >= 0.97)"
    )


if __name__ == "__main__":
    main()
