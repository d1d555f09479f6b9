from __future__ import annotations

import numpy as np

from router.tokenizer import TOKEN_DTYPE, ByteTokenizer


def test_round_trip_ascii_and_non_ascii() -> None:
    tok = ByteTokenizer()
    for text in ["hello world\n", "naïve café — 東京 🚀", ""]:
        ids = tok.encode(text)
        assert all(0 <= i < 256 for i in ids)
        assert len(ids) == len(text.encode("utf-8"))
        assert tok.decode(ids) == text


def test_eos_is_dropped_and_bad_utf8_replaced() -> None:
    tok = ByteTokenizer()
    assert tok.vocab_size == 257 and tok.EOS == 256
    assert tok.decode([*tok.encode("ab"), tok.EOS, *tok.encode("c")]) == "abc"
    assert tok.decode([0xC3]) == "\ufffd"  # half of a two-byte character


def test_encode_array_is_little_endian_uint16_with_eos() -> None:
    tok = ByteTokenizer()
    arr = tok.encode_array("é", eos=True)
    assert arr.dtype == TOKEN_DTYPE == np.dtype("<u2")
    assert arr.tobytes() == bytes([0xC3, 0, 0xA9, 0, 0x00, 0x01])


def test_prefix_text_counts_bytes() -> None:
    tok = ByteTokenizer()
    assert tok.prefix_text("abcdef", 3) == "abc"
    assert tok.prefix_text("aé", 2) == "a\ufffd"
