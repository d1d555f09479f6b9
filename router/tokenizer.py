"""Byte-level tokenizer: 256 byte values plus one end-of-document token (matches `ModelConfig.vocab_size`)."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

TOKEN_DTYPE = np.dtype("<u2")
"""Token files on disk are little-endian uint16, whatever the host byte order."""


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255; token 256 (`EOS`) ends a document."""

    vocab_size = 257
    EOS = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_array(self, text: str, *, eos: bool = False) -> np.ndarray:
        """The tokens of `text` as a `TOKEN_DTYPE` array, optionally followed by EOS."""
        data = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(TOKEN_DTYPE)
        if eos:
            data = np.append(data, np.array([self.EOS], dtype=TOKEN_DTYPE))
        return data

    def decode(self, ids: Iterable[int]) -> str:
        """Bytes back to text; EOS (and anything outside 0..255) is dropped, bad UTF-8 becomes U+FFFD."""
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def prefix_text(self, text: str, prefix_tokens: int) -> str:
        """The text of the first `prefix_tokens` tokens of `text` (a cut character becomes U+FFFD)."""
        return text.encode("utf-8")[:prefix_tokens].decode("utf-8", errors="replace")
