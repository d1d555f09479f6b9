"""Byte-level BPE tokenizer trained offline on the train split with the `tokenizers` library.

`train_bpe` learns the merges from a stream of texts (nothing is downloaded); the result is saved as
`tokenizer.json` next to the shards (`ShardOptions(tokenizer="bpe")`) so evaluation encodes with the same
one (islands only see token ids). Byte-level: every text is representable (the 256 byte symbols are always in
the vocabulary), and `decode(encode(text)) == text` for any valid `str`.

EOS: the special token `<|endoftext|>` is trained first, so its id is always 0 (`BPETokenizer.EOS`); it is
appended after every document in the shard files, exactly like `ByteTokenizer.EOS` (256) for byte shards, and
is never produced by encoding text (the literal string `<|endoftext|>` inside a document is split like any
other text, since special tokens are not matched in the input). `decode` drops it. Token ids are
`0 .. vocab_size-1` with `vocab_size <= 65535`, so shard files stay little-endian uint16.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from router.tokenizer import TOKEN_DTYPE

EOS_TOKEN = "<|endoftext|>"
TOKENIZER_FILE = "tokenizer.json"
MIN_VOCAB_SIZE = 257
"""256 byte symbols + EOS."""
MAX_VOCAB_SIZE = 65535
"""Largest vocabulary whose ids fit uint16 shard files."""


class BPEError(ValueError):
    """A BPE tokenizer cannot be trained or loaded."""


class BPETokenizer:
    """A trained byte-level BPE (`tokenizers.Tokenizer`) with the `ByteTokenizer` interface used by shards."""

    EOS = 0

    def __init__(self, tokenizer: object) -> None:
        from tokenizers import Tokenizer

        assert isinstance(tokenizer, Tokenizer)
        if tokenizer.token_to_id(EOS_TOKEN) != self.EOS:
            raise BPEError(
                f"the tokenizer's {EOS_TOKEN} has id {tokenizer.token_to_id(EOS_TOKEN)}, expected {self.EOS}"
            )
        if tokenizer.get_vocab_size() > MAX_VOCAB_SIZE:
            raise BPEError(f"vocabulary of {tokenizer.get_vocab_size()} does not fit uint16 token files")
        tokenizer.encode_special_tokens = True  # `<|endoftext|>` inside a text is text, never EOS
        self._tok = tokenizer

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size())

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_array(self, text: str, *, eos: bool = False) -> np.ndarray:
        """The tokens of `text` as a `TOKEN_DTYPE` array, optionally followed by EOS."""
        ids = self.encode(text)
        if eos:
            ids.append(self.EOS)
        return np.asarray(ids, dtype=TOKEN_DTYPE)

    def encode_batch_arrays(self, texts: list[str], *, eos: bool = False) -> list[np.ndarray]:
        """`encode_array` of each text, encoded in parallel by the library (the same ids, in order)."""
        encodings = self._tok.encode_batch(texts, add_special_tokens=False)
        tail = [self.EOS] if eos else []
        return [np.asarray(list(e.ids) + tail, dtype=TOKEN_DTYPE) for e in encodings]

    def decode(self, ids: Iterable[int]) -> str:
        """Tokens back to text; EOS is dropped."""
        return str(self._tok.decode([int(i) for i in ids if int(i) != self.EOS], skip_special_tokens=True))

    def save(self, path: Path) -> None:
        self._tok.save(str(path), pretty=True)

    @classmethod
    def load(cls, path: Path) -> BPETokenizer:
        from tokenizers import Tokenizer

        if not path.is_file():
            raise BPEError(f"no BPE tokenizer at {path}")
        return cls(Tokenizer.from_file(str(path)))


def train_bpe(texts: Iterable[str], *, vocab_size: int, min_frequency: int = 2) -> BPETokenizer:
    """Train a byte-level BPE on `texts` (streamed) offline; deterministic for the same texts and parameters."""
    if not MIN_VOCAB_SIZE <= vocab_size <= MAX_VOCAB_SIZE:
        raise BPEError(f"vocab_size={vocab_size} must be in [{MIN_VOCAB_SIZE}, {MAX_VOCAB_SIZE}]")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        show_progress=False,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )

    def batches() -> Iterator[list[str]]:
        batch: list[str] = []
        for text in texts:
            batch.append(text)
            if len(batch) == 1024:
                yield batch
                batch = []
        if batch:
            yield batch

    tok.train_from_iterator(batches(), trainer=trainer)
    return BPETokenizer(tok)
