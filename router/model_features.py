"""Prefix features from a trained path model (DiPaCo §2.4: the paper routes on the model's own representation):
the mean of the final-norm hidden state (`PathModel.hidden`, gpt2 or llama blocks) over the first `prefix_tokens`
byte tokens, L2-normalised.

A `ModelFeaturizer` is saved with the router it feeds (safetensors weights + JSON config, never pickle), so
routing at shard time and at evaluation time uses the same model. Any path can serve, e.g. one written by
`dipaco export` (`load_exported`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from modules import ModelConfig, PathModel
from router.tokenizer import ByteTokenizer

WEIGHTS_FILE = "featurizer.safetensors"
CONFIG_FILE = "featurizer.json"


class FeaturizerError(ValueError):
    """A featurizer model that cannot be loaded or does not fit the router."""


@dataclass
class ModelFeaturizer:
    cfg: ModelConfig
    model: PathModel
    batch_size: int = 256

    @classmethod
    def from_state(cls, cfg: ModelConfig, state: dict[str, torch.Tensor]) -> ModelFeaturizer:
        model = PathModel(cfg)
        try:
            model.load_state_dict(state, strict=True)
        except RuntimeError as exc:
            raise FeaturizerError(f"featurizer weights do not fit the model config: {exc}") from exc
        model.eval()
        return cls(cfg=cfg, model=model)

    @torch.no_grad()
    def embed(self, texts: list[str], *, prefix_tokens: int) -> np.ndarray:
        """(len(texts), d_model) float32 features; only the first `prefix_tokens` bytes of a text matter."""
        if prefix_tokens > self.cfg.seq_len:
            raise FeaturizerError(f"prefix of {prefix_tokens} tokens is longer than the model's {self.cfg.seq_len}")
        tok = ByteTokenizer()
        out = np.zeros((len(texts), self.cfg.d_model), dtype=np.float32)
        m = self.model
        for start in range(0, len(texts), self.batch_size):
            ids = [tok.encode(t)[:prefix_tokens] or [tok.EOS] for t in texts[start : start + self.batch_size]]
            length = max(len(i) for i in ids)
            # right padding: causal attention keeps every real position blind to the padding after it
            batch = torch.tensor([i + [tok.EOS] * (length - len(i)) for i in ids])
            mask = torch.tensor([[1.0] * len(i) + [0.0] * (length - len(i)) for i in ids])
            h = m.hidden(batch)  # (B, T, d): the final norm's output, for either block style
            mean = (h * mask[:, :, None]).sum(1) / mask.sum(1, keepdim=True)
            out[start : start + len(ids)] = torch.nn.functional.normalize(mean, dim=1).numpy()
        return out

    def save(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        tmp = directory / f".{WEIGHTS_FILE}.tmp-{os.getpid()}"
        save_file({k: v.contiguous() for k, v in self.model.state_dict().items()}, str(tmp))
        os.replace(tmp, directory / WEIGHTS_FILE)
        tmp = directory / f".{CONFIG_FILE}.tmp-{os.getpid()}"
        tmp.write_text(json.dumps(self.cfg.to_dict(), indent=2, sort_keys=True) + "\n")
        os.replace(tmp, directory / CONFIG_FILE)

    @classmethod
    def load(cls, directory: Path, *, weights: str = WEIGHTS_FILE, config: str = CONFIG_FILE) -> ModelFeaturizer:
        wpath, cpath = directory / weights, directory / config
        if not wpath.is_file() or not cpath.is_file():
            raise FeaturizerError(f"no featurizer model in {directory} (need {config} and {weights})")
        try:
            cfg = ModelConfig.from_dict(json.loads(cpath.read_text()))
        except (ValueError, TypeError) as exc:
            raise FeaturizerError(f"{cpath}: not a model config: {exc}") from exc
        return cls.from_state(cfg, load_file(str(wpath)))


def load_exported(directory: Path) -> ModelFeaturizer:
    """A path written by `dipaco export` (model.safetensors + config.json) as a featurizer."""
    return ModelFeaturizer.load(directory, weights="model.safetensors", config="config.json")
