"""Sparse embedding rows (`modules.sparse_rows`): the per-row outer round, the wire format in every codec, and the
reference simulators with `sparse_rows` on."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from modules import (
    ErrorFeedback,
    InnerConfig,
    ModelConfig,
    OuterConfig,
    RoundAccumulator,
    decode_grad,
    encode_grad,
    expand_rows,
    grad_norm,
    grad_payload_nbytes,
    init_level_modules,
    parse_layout,
    simulate,
    touched_rows,
)
from modules.asynchrony import AsyncSettings, Lease, Upload, simulate_async
from modules.codec import GRAD_CODECS, CodecError, decode_grad_part, read_metadata

AVERAGE = OuterConfig(method="average", max_norm=None, max_norm_ratio=None)
NESTEROV = OuterConfig(lr=0.5, momentum=0.9, max_norm=None, max_norm_ratio=None)


def part(values: torch.Tensor, rows: list[int], dense: torch.Tensor) -> dict[str, torch.Tensor]:
    """A sparse part in memory: `emb` (4, 2) with `values` on `rows`, zeros elsewhere; `w` dense."""
    full = torch.zeros(4, 2)
    full[rows] = values
    return {"emb": full, "emb::rows": torch.tensor(rows), "w": dense}


def test_each_row_is_averaged_over_the_parts_that_sent_it() -> None:
    params = {"emb": torch.arange(8.0).view(4, 2), "w": torch.ones(3)}
    a = part(torch.tensor([[1.0, 2.0], [3.0, 4.0]]), [0, 1], torch.full((3,), 1.0))
    b = part(torch.tensor([[5.0, 6.0], [7.0, 8.0]]), [1, 2], torch.full((3,), 5.0))
    acc = RoundAccumulator()
    acc.add(a, 1.0)
    acc.add(b, 3.0)
    mean = acc.mean()
    # row 0: only a; row 1: (1 * a + 3 * b) / 4; row 2: only b; row 3: nobody (0 in the mean)
    want = torch.tensor([[1.0, 2.0], [(3 + 15) / 4, (4 + 18) / 4], [7.0, 8.0], [0.0, 0.0]])
    torch.testing.assert_close(mean["emb"], want, rtol=0, atol=0)
    torch.testing.assert_close(mean["w"], torch.full((3,), (1 + 15) / 4), rtol=0, atol=0)
    new, momentum = acc.finish(params, None, AVERAGE)
    torch.testing.assert_close(new["emb"], params["emb"] - want, rtol=0, atol=0)
    assert momentum is None
    assert grad_norm(a) == pytest.approx((1 + 4 + 9 + 16 + 3) ** 0.5)  # the row ids are not values


def test_rows_nobody_sent_keep_weights_and_momentum() -> None:
    params = {"emb": torch.arange(8.0).view(4, 2), "w": torch.ones(3)}
    buf = {"emb": torch.full((4, 2), 0.25), "w": torch.full((3,), 0.5)}
    a = part(torch.tensor([[1.0, 2.0], [3.0, 4.0]]), [0, 1], torch.full((3,), 2.0))
    acc = RoundAccumulator()
    acc.add(a, 2.0)
    new, momentum = acc.finish(params, buf, NESTEROV)
    assert momentum is not None
    g = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    want_buf = 0.9 * 0.25 + g
    torch.testing.assert_close(momentum["emb"][:2], want_buf)
    torch.testing.assert_close(new["emb"][:2], params["emb"][:2] - 0.5 * (g + 0.9 * want_buf))
    # rows 2 and 3: as if the round never happened (no decay of the buffer, no step by the old momentum)
    assert torch.equal(new["emb"][2:], params["emb"][2:]) and torch.equal(momentum["emb"][2:], buf["emb"][2:])
    torch.testing.assert_close(momentum["w"], 0.9 * 0.5 + torch.full((3,), 2.0))
    assert torch.equal(buf["emb"], torch.full((4, 2), 0.25))  # the input is not touched
    # no buffer yet: zeros on the rows nobody sent, the weights as they were
    new0, momentum0 = RoundAccumulator().finish(params, None, NESTEROV)  # nobody at all: module unchanged
    assert momentum0 is None and torch.equal(new0["emb"], params["emb"])
    acc = RoundAccumulator()
    acc.add(a, 1.0)
    new1, momentum1 = acc.finish(params, None, NESTEROV)
    assert momentum1 is not None
    assert torch.equal(momentum1["emb"][2:], torch.zeros(2, 2)) and torch.equal(new1["emb"][2:], params["emb"][2:])


def test_dense_and_sparse_parts_mix_and_sqrt_rescale_counts_per_row() -> None:
    dense = {"emb": torch.ones(4, 2), "w": torch.zeros(3)}
    sparse = part(torch.tensor([[3.0, 3.0]]), [2], torch.zeros(3))
    acc = RoundAccumulator()
    acc.add(dense, 1.0)  # before any sparse part: every row counted once
    acc.add(sparse, 1.0)
    want = torch.tensor([[1.0, 1.0], [1.0, 1.0], [2.0, 2.0], [1.0, 1.0]])
    torch.testing.assert_close(acc.mean()["emb"], want, rtol=0, atol=0)
    params = {"emb": torch.zeros(4, 2), "w": torch.zeros(3)}
    new, _ = acc.finish(params, None, OuterConfig(method="average", sqrt_rescale=True))
    scale = torch.tensor([1.0, 1.0, 2**0.5, 1.0]).view(4, 1)  # row 2 had two parts, the others one
    torch.testing.assert_close(new["emb"], -want * scale)


def test_dense_parts_are_unchanged_bit_for_bit() -> None:
    gen = torch.Generator().manual_seed(0)
    grads = [{"a": torch.randn(5, 3, generator=gen), "b": torch.randn(4, generator=gen)} for _ in range(3)]
    acc = RoundAccumulator()
    total = None
    for i, g in enumerate(grads):
        acc.add(g, float(i + 1))
        total = (
            {k: v * float(i + 1) for k, v in g.items()}
            if total is None
            else {k: total[k] + v * float(i + 1) for k, v in g.items()}
        )
    assert total is not None
    mean = acc.mean()
    assert all(torch.equal(mean[k], total[k] / 6.0) for k in total)


def test_touched_rows_are_the_sorted_unique_inputs() -> None:
    batches = [(torch.tensor([[5, 1, 5]]), torch.tensor([[1, 5, 9]])), (torch.tensor([[3, 1, 0]]), torch.tensor([[8]]))]
    assert touched_rows(batches, 10).tolist() == [0, 1, 3, 5]  # 8 and 9 are only targets


@pytest.mark.parametrize("codec", GRAD_CODECS)
def test_sparse_payload_round_trip(codec: str) -> None:
    gen = torch.Generator().manual_seed(1)
    grads = {"embed/tok_emb.weight": torch.randn(300, 8, generator=gen), "embed/pos_emb.weight": torch.randn(4, 8)}
    ids = torch.tensor([2, 40, 41, 299])
    feedback = ErrorFeedback()
    data = encode_grad(grads, codec, rows={"embed/tok_emb.weight": ids}, error_feedback=feedback)  # type: ignore[arg-type]
    shapes = {"embed/tok_emb.weight": [4, 8], "embed/tok_emb.weight::rows": [4], "embed/pos_emb.weight": [4, 8]}
    assert len(data) == grad_payload_nbytes(shapes, codec)  # type: ignore[arg-type]
    assert len(data) < len(encode_grad(grads, codec)) / 4  # 4 of 300 rows; the header weighs the rest  # type: ignore[arg-type]
    decoded = decode_grad(data)
    assert decoded["embed/tok_emb.weight::rows"].dtype == torch.int64
    assert torch.equal(decoded["embed/tok_emb.weight::rows"], ids)
    assert decoded["embed/tok_emb.weight"].shape == (4, 8)
    tol = {"fp32": 0.0, "bf16": 0.02, "int8": 0.03}[codec]
    torch.testing.assert_close(decoded["embed/tok_emb.weight"], grads["embed/tok_emb.weight"][ids], rtol=0, atol=tol)
    # lazily, one module at a time, as the apply reads a blob
    tensors = st_load(data)
    lazy = decode_grad_part(
        {k: list(v.shape) for k, v in tensors.items()}, read_metadata(data), tensors.__getitem__, "embed/"
    )
    assert set(lazy) == {"tok_emb.weight", "tok_emb.weight::rows", "pos_emb.weight"}
    assert torch.equal(lazy["tok_emb.weight"], decoded["embed/tok_emb.weight"])
    full = expand_rows(lazy, {"tok_emb.weight": grads["embed/tok_emb.weight"], "pos_emb.weight": torch.zeros(4, 8)})
    assert full["tok_emb.weight"].shape == (300, 8)
    assert torch.equal(full["tok_emb.weight"][ids], decoded["embed/tok_emb.weight"])
    assert int((full["tok_emb.weight"].abs().sum(dim=1) > 0).sum()) == 4
    # the rows not sent wait in the residual whole; the rows sent keep only what the codec lost
    unsent = torch.ones(300, dtype=torch.bool)
    unsent[ids] = False
    residual = feedback.residual["embed/tok_emb.weight"]
    assert torch.equal(residual[unsent], grads["embed/tok_emb.weight"][unsent])
    assert float(residual[ids].abs().max()) <= tol


def test_row_ids_must_be_int64() -> None:
    data = st_save({"e/x": torch.zeros(2, 2), "e/x::rows": torch.tensor([0.0, 1.0])}, metadata={"dipaco.codec": "fp32"})
    with pytest.raises(CodecError, match="tensor 'e/x::rows' has dtype F32, expected I64"):
        decode_grad(data)
    with pytest.raises(CodecError, match="rows given for tensors not in the gradient"):
        encode_grad({"a": torch.zeros(2)}, "fp32", rows={"b": torch.tensor([0])})


CFG = ModelConfig(seq_len=16, d_model=32, n_layers=2, n_heads=4)
INNER = InnerConfig(lr=3e-3, warmup_steps=2, total_steps=12, batch_size=2)
LAYOUT = parse_layout("embed:shared, b0-0:routed2, b1-1:routed2, head:shared", n_layers=2)


def shard(path: int, n: int = 600) -> torch.Tensor:
    """Path p's tokens lie in [10p, 10p + 50): every path sees a different part of the vocabulary."""
    i = torch.arange(n)
    return ((i * (3 + 2 * path) + (i // 7) * (path + 1)) % 50 + 10 * path) % CFG.vocab_size


@pytest.mark.parametrize("codec", ["fp32", "int8"])
def test_simulator_keeps_rows_no_path_saw(codec: str) -> None:
    tokens = [shard(p) for p in range(4)]
    kw = {"steps_per_round": 2, "rounds": 2, "seed": 0, "tokens": tokens, "codec": codec}
    sparse = simulate(CFG, LAYOUT, INNER, OuterConfig(), sparse_rows=True, **kw)  # type: ignore[arg-type]
    dense = simulate(CFG, LAYOUT, INNER, OuterConfig(), **kw)  # type: ignore[arg-type]
    init = init_level_modules(CFG, LAYOUT, seed=0)[0]["tok_emb.weight"]
    got, ref = sparse.modules[0][0]["tok_emb.weight"], dense.modules[0][0]["tok_emb.weight"]
    assert torch.equal(got[80:], init[80:])  # no path's input reaches row 80 or beyond
    assert not torch.equal(ref[80:], init[80:])  # dense: weight decay moved them
    assert not torch.equal(got[:80], init[:80])
    momentum = sparse.momentum[0][0]
    assert momentum is not None and torch.equal(momentum["tok_emb.weight"][80:], torch.zeros_like(got[80:]))
    # the other modules do not see the difference in round 0 (same losses), and the run trains alike
    assert sparse.losses[0] == dense.losses[0]
    assert sparse.losses[-1] == pytest.approx(dense.losses[-1], rel=0.02)


def test_async_reference_in_round_order_equals_the_simulator_with_sparse_rows() -> None:
    tokens = [shard(p) for p in range(4)]
    ref = simulate(
        CFG, LAYOUT, INNER, OuterConfig(), steps_per_round=2, rounds=2, seed=0, tokens=tokens, codec="int8",
        sparse_rows=True,
    )  # fmt: skip
    events: list[Lease | Upload] = []
    for _ in range(2):
        events += [Lease(p, 2) for p in range(4)] + [Upload(p) for p in range(4)]
    got = simulate_async(
        CFG, LAYOUT, INNER, OuterConfig(), AsyncSettings(sync="async"), events=events, budget_steps=4, seed=0,
        tokens=tokens, codec="int8", sparse_rows=True,
    )  # fmt: skip
    for lv in range(4):
        for m, weights in enumerate(ref.modules[lv]):
            assert all(torch.equal(got.modules[lv][m][k], weights[k]) for k in weights)


def test_tied_embeddings_are_refused() -> None:
    tied = ModelConfig.from_dict({**CFG.to_dict(), "tie_embeddings": True})
    with pytest.raises(ValueError, match="sparse_rows needs untied embeddings"):
        simulate(tied, LAYOUT, INNER, OuterConfig(), steps_per_round=1, rounds=1, seed=0,
                 tokens=[shard(p) for p in range(4)], sparse_rows=True)  # fmt: skip
