"""Outer-gradient codecs: bytes per contribution and encode/decode time, against fp32 measured in the same run.

    python bench/bench_codec.py [--flavours debug,small,paper-150m] [--repeats 3]

For each flavour, one contribution is a whole path's outer gradient (every module of a 2x2 path: the full model).
Sizes are exact (`modules.grad_payload_nbytes`, checked against a real encode for the flavours small enough to
allocate); times are the median of `--repeats` encodes and decodes of a real gradient (Gaussian values of the
size of a few AdamW steps). Also the relative error of one int8 round trip, and of the mean of 8 rounds with
error feedback (the island's setting), which is what reaches the modules. Target: int8 <= 0.27x fp32 bytes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from modules import ErrorFeedback, decode_grad, encode_grad, flavour, grad_payload_nbytes, init_state

TARGET = 0.27


def _timed(fn: object, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _flavour_row(name: str, repeats: int, allocate: bool) -> dict[str, object]:
    cfg = flavour(name)
    with torch.device("meta"):
        shapes = {k: list(v.shape) for k, v in init_state(cfg, seed=0).items()}
    params = sum(torch.Size(s).numel() for s in shapes.values())
    sizes = {codec: grad_payload_nbytes(shapes, codec) for codec in ("fp32", "bf16", "int8")}
    row: dict[str, object] = {
        "flavour": name,
        "params": params,
        "bytes": sizes,
        "bf16_ratio": round(sizes["bf16"] / sizes["fp32"], 4),
        "int8_ratio": round(sizes["int8"] / sizes["fp32"], 4),
    }
    if not allocate:
        return row
    gen = torch.Generator().manual_seed(0)
    grads = {k: torch.randn(*s, generator=gen) * 1e-3 for k, s in shapes.items()}
    for codec in ("fp32", "bf16", "int8"):
        payload = encode_grad(grads, codec)
        assert len(payload) == sizes[codec], (codec, len(payload), sizes[codec])
        row[f"{codec}_encode_s"] = round(_timed(lambda c=codec: encode_grad(grads, c), repeats), 4)
        row[f"{codec}_decode_s"] = round(_timed(lambda p=payload: decode_grad(p), repeats), 4)
    once = decode_grad(encode_grad(grads, "int8"))
    row["int8_rel_error_once"] = _rel(once, grads)
    feedback, sums_sent, sums_true = ErrorFeedback(), {}, {}
    for step in range(8):  # the same kind of gradient 8 rounds in a row, as a path sees them
        g = {k: torch.randn(*s, generator=gen) * 1e-3 for k, s in shapes.items()}
        back = decode_grad(encode_grad(g, "int8", error_feedback=feedback))
        for k in g:
            sums_sent[k] = back[k] + (sums_sent[k] if step else 0)
            sums_true[k] = g[k] + (sums_true[k] if step else 0)
    row["int8_rel_error_8_rounds_feedback"] = _rel(sums_sent, sums_true)
    return row


def _rel(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    num = sum(float(((got[k] - want[k]) ** 2).sum()) for k in want)
    den = sum(float((want[k] ** 2).sum()) for k in want)
    return round((num / den) ** 0.5, 6)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flavours", default="debug,small,paper-150m")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows = [_flavour_row(name, args.repeats, allocate=name != "paper-150m") for name in args.flavours.split(",")]
    ok = all(float(str(r["int8_ratio"])) <= TARGET for r in rows)
    print(json.dumps({"bench": "codec", "target_int8_ratio": TARGET, "rows": rows, "ok": ok}, indent=2))


if __name__ == "__main__":
    main()
