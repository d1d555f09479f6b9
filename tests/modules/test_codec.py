"""Tensor codecs: fp32 safetensors, outer-gradient codecs (fp32/bf16/int8), error feedback, exact sizes."""

from __future__ import annotations

import struct

import pytest
import torch
from safetensors.torch import save as st_save

from modules import (
    CodecError,
    ErrorFeedback,
    ModelConfig,
    decode,
    decode_grad,
    encode,
    encode_grad,
    flavour,
    grad_payload_nbytes,
    init_state,
    parse_layout,
    split_state,
)
from modules.codec import dequantize_int8, encode_pieces, quantize_int8, read_metadata


def grads(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "blocks.0.attn.qkv.weight": torch.randn(96, 32, generator=gen) * 1e-3,
        "blocks.0.attn.qkv.bias": torch.randn(96, generator=gen) * 1e-4,
        "odd": torch.randn(3, 5, 7, generator=gen),  # 105 values: a partial last block
        "zeros": torch.zeros(300),
    }


def test_encode_decode_round_trip() -> None:
    t = grads()
    back = decode(encode(t, metadata={"round": "3"}))
    assert back.keys() == t.keys()
    assert all(torch.equal(back[n], t[n]) for n in t)


@pytest.mark.parametrize(
    "tensors",
    [
        {},
        {"only": torch.zeros(0)},
        {"scalar": torch.tensor(2.5), "b": torch.arange(7.0), "a": torch.ones(3, 4)},
        {"t": torch.arange(12.0).reshape(3, 4).t(), "é/name": torch.full((5,), -0.0)},  # not contiguous; unicode
        {f"blocks.{i}.w": torch.randn(9, 5, generator=torch.Generator().manual_seed(i)) for i in range(12)},
    ],
    ids=["empty", "zero-size", "scalar-and-order", "strided-unicode", "many"],
)
def test_encode_pieces_are_encodes_bytes(tensors: dict[str, torch.Tensor]) -> None:
    assert b"".join(encode_pieces(tensors)) == encode(tensors)


def test_encode_pieces_refuses_other_dtypes() -> None:
    with pytest.raises(CodecError, match="'h' is torch.float16"):
        encode_pieces({"w": torch.zeros(2), "h": torch.zeros(2, dtype=torch.float16)})


def test_decode_refuses_dtypes_outside_allow_list() -> None:
    data = encode({"x": torch.zeros(3, dtype=torch.float64)})
    with pytest.raises(CodecError, match=r"tensor 'x' has dtype F64; allowed: \['F32'\]"):
        decode(data)
    assert decode(data, allowed_dtypes=frozenset({"F64"}))["x"].dtype == torch.float64


@pytest.mark.parametrize("cut", [0, 5, 8, 20, -1])
def test_truncated_payload_is_codec_error(cut: int) -> None:
    data = encode(grads())
    with pytest.raises(CodecError):
        decode(data[:cut])
    with pytest.raises(CodecError):
        decode_grad(encode_grad(grads(), "int8")[:cut])


def test_garbage_header_is_codec_error() -> None:
    with pytest.raises(CodecError, match="not valid JSON"):
        decode(struct.pack("<Q", 4) + b"\xff{{{")
    with pytest.raises(CodecError, match="not a JSON object"):
        decode(struct.pack("<Q", 2) + b"[]")


def test_fp32_grad_is_exact() -> None:
    t = grads()
    back = decode_grad(encode_grad(t, "fp32"))
    assert all(torch.equal(back[n], t[n]) for n in t)


def test_bf16_round_trip_error_bound() -> None:
    t = grads()
    data = encode_grad(t, "bf16")
    assert read_metadata(data)["dipaco.codec"] == "bf16"
    back = decode_grad(data)
    for n in t:
        assert back[n].dtype == torch.float32 and back[n].shape == t[n].shape
        # bf16 keeps 8 significant bits: round-to-nearest relative error <= 2**-8
        assert torch.all((back[n] - t[n]).abs() <= t[n].abs() * 2**-8)


@pytest.mark.parametrize("block_size", [1, 64, 256, 1000])
def test_int8_round_trip_error_bound(block_size: int) -> None:
    t = grads()
    data = encode_grad(t, "int8", block_size=block_size)
    meta = read_metadata(data)
    assert meta == {"dipaco.codec": "int8", "dipaco.block_size": str(block_size)}
    back = decode_grad(data)
    assert back.keys() == t.keys()
    for n in t:
        flat = t[n].reshape(-1)
        pad = (-flat.numel()) % block_size
        absmax = torch.nn.functional.pad(flat.abs(), (0, pad)).view(-1, block_size).amax(dim=1)
        bound = (absmax / 127 / 2).repeat_interleave(block_size)[: flat.numel()] * (1 + 1e-5) + 1e-12
        assert torch.all((back[n].reshape(-1) - flat).abs() <= bound), n
    assert torch.equal(back["zeros"], torch.zeros(300))


def test_int8_tensor_names_and_dtypes() -> None:
    data = encode_grad({"a.weight": torch.randn(10, 30)}, "int8", block_size=64)
    raw = decode(data, allowed_dtypes=frozenset({"I8", "F32"}))
    assert raw["a.weight"].dtype == torch.int8 and raw["a.weight"].shape == (10, 30)
    assert raw["::scales"].dtype == torch.float32 and raw["::scales"].shape == (5,)


def test_quantize_extremes_are_exact() -> None:
    x = torch.tensor([-3.0, 0.0, 1.5, 3.0])
    q, s = quantize_int8(x, block_size=4)
    assert q.tolist() == [-127, 0, 64, 127]
    torch.testing.assert_close(dequantize_int8(q, s, block_size=4)[[0, 1, 3]], x[[0, 1, 3]])
    with pytest.raises(CodecError, match="need 1 scales, got 2"):
        dequantize_int8(q, torch.ones(2), block_size=4)


def test_decode_grad_refuses_bad_payloads() -> None:
    with pytest.raises(CodecError, match="no 'dipaco.codec' metadata"):
        decode_grad(encode({"x": torch.zeros(2)}))
    with pytest.raises(CodecError, match="unknown gradient codec 'fp8'"):
        decode_grad(st_save({"x": torch.zeros(2)}, metadata={"dipaco.codec": "fp8"}))
    with pytest.raises(CodecError, match=r"tensor 'x' has dtype F64; codec fp32 allows \['F32'\]"):
        decode_grad(st_save({"x": torch.zeros(2, dtype=torch.float64)}, metadata={"dipaco.codec": "fp32"}))
    with pytest.raises(CodecError, match=r"codec bf16 allows \['BF16'\]"):
        decode_grad(st_save({"x": torch.zeros(2)}, metadata={"dipaco.codec": "bf16"}))
    int8_meta = {"dipaco.codec": "int8", "dipaco.block_size": "4"}
    with pytest.raises(CodecError, match="'x' has dtype F32, expected I8"):
        decode_grad(st_save({"x": torch.zeros(2), "::scales": torch.ones(1)}, metadata=int8_meta))
    with pytest.raises(CodecError, match="int8 payload has no '::scales' tensor"):
        decode_grad(st_save({"x": torch.zeros(2, dtype=torch.int8)}, metadata=int8_meta))
    with pytest.raises(CodecError, match="need 1 scales, got 3"):
        decode_grad(st_save({"x": torch.zeros(2, dtype=torch.int8), "::scales": torch.ones(3)}, metadata=int8_meta))
    with pytest.raises(CodecError, match="need 1 scales, got 0"):
        decode_grad(st_save({"x": torch.zeros(2, dtype=torch.int8), "::scales": torch.ones(0)}, metadata=int8_meta))
    with pytest.raises(CodecError, match="bad dipaco.block_size 'big'"):
        decode_grad(
            st_save(
                {"x": torch.zeros(2, dtype=torch.int8), "::scales": torch.ones(1)},
                metadata={"dipaco.codec": "int8", "dipaco.block_size": "big"},
            )
        )


def test_encode_grad_refuses_bad_input() -> None:
    with pytest.raises(CodecError, match="unknown gradient codec 'int4'"):
        encode_grad(grads(), "int4")  # type: ignore[arg-type]
    with pytest.raises(CodecError, match="block_size must be >= 1"):
        encode_grad(grads(), "int8", block_size=0)
    with pytest.raises(CodecError, match="reserved codec suffix"):
        encode_grad({"x::scale": torch.zeros(1)}, "fp32")
    with pytest.raises(CodecError, match="floating-point"):
        encode_grad({"x": torch.zeros(1, dtype=torch.long)}, "fp32")


@pytest.mark.parametrize("codec", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("block_size", [7, 256])
@pytest.mark.parametrize("block", ["gpt2", "llama"])
def test_payload_size_is_exact(codec: str, block_size: int, block: str) -> None:
    cfg = ModelConfig.from_dict({**flavour("debug").to_dict(), "block": block})
    layout = parse_layout("embed:shared, b0-0:routed2, b1-1:routed2, head:shared", n_layers=cfg.n_layers)
    for module in [*split_state(init_state(cfg, seed=0), layout), grads()]:
        shapes = {n: tuple(t.shape) for n, t in module.items()}
        size = grad_payload_nbytes(shapes, codec, block_size=block_size)  # type: ignore[arg-type]
        assert size == len(encode_grad(module, codec, block_size=block_size))  # type: ignore[arg-type]


@pytest.mark.parametrize("block", ["gpt2", "llama"])
def test_int8_payload_is_at_most_026_of_fp32(block: str) -> None:
    def cfg(name: str) -> ModelConfig:
        return ModelConfig.from_dict({**flavour(name).to_dict(), "block": block})

    debug = split_state(
        init_state(cfg("debug"), seed=0), parse_layout("embed:shared, b0-1:shared, head:shared", n_layers=2)
    )[1]
    # the debug model's block weight matrices (qkv, attn proj, fc, mlp proj of both blocks)
    matrices = {n: t for n, t in debug.items() if t.dim() == 2}
    small = split_state(
        init_state(cfg("small"), seed=0),
        parse_layout("embed:shared, b0-0:routed2, b1-3:shared, head:shared", n_layers=4),
    )[1]
    for module in (matrices, small):
        fp32 = len(encode_grad(module, "fp32"))
        int8 = len(encode_grad(module, "int8"))
        assert int8 <= 0.26 * fp32, (int8, fp32, int8 / fp32)
    # a whole debug block module (incl. norms and biases; gpt2: 24 tensors of 100k values, llama: 12): all block
    # scales share one header entry, so the header stays small
    whole = len(encode_grad(debug, "int8")) / len(encode_grad(debug, "fp32"))
    assert whole <= 0.26, whole


def test_error_feedback_carries_the_residual() -> None:
    gen = torch.Generator().manual_seed(1)
    g = {"w": torch.randn(1000, generator=gen)}
    fb = ErrorFeedback()
    first = decode_grad(encode_grad(g, "int8", block_size=1000, error_feedback=fb))
    torch.testing.assert_close(fb.residual["w"], g["w"] - first["w"], rtol=0, atol=0)
    second = decode_grad(encode_grad(g, "int8", block_size=1000, error_feedback=fb))
    # what was sent over two rounds is 2g minus only the last residual: the error does not accumulate
    torch.testing.assert_close(first["w"] + second["w"], 2 * g["w"] - fb.residual["w"], rtol=0, atol=1e-6)
    sent_total = torch.zeros(1000)
    no_fb_total = torch.zeros(1000)
    fb.reset()
    for _ in range(20):
        sent_total += decode_grad(encode_grad(g, "int8", block_size=1000, error_feedback=fb))["w"]
        no_fb_total += decode_grad(encode_grad(g, "int8", block_size=1000))["w"]
    err_fb = (sent_total - 20 * g["w"]).abs().max()
    err_plain = (no_fb_total - 20 * g["w"]).abs().max()
    assert err_fb < err_plain / 5
    # fp32 leaves a zero residual
    fb32 = ErrorFeedback()
    encode_grad(g, "fp32", error_feedback=fb32)
    assert torch.equal(fb32.residual["w"], torch.zeros(1000))
