"""Composing a path from module weights and splitting a trained path back into modules (DiPaCo §2.1).

Module tensors keep the parameter names they have in the path model, so a module's identity and tensor names
are stable across versions and across the paths that share it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from modules.config import ModelConfig
from modules.layout import Layout, LayoutError
from modules.model import PathModel, init_state

Tensors = dict[str, torch.Tensor]


def _model_param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Parameter shapes of the path model; cached, the coordinator checks them on every upload."""
    return _shapes_of(tuple(sorted(dataclasses.asdict(cfg).items())))


@functools.lru_cache(maxsize=64)
def _shapes_of(fields: tuple[tuple[str, Any], ...]) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):  # shapes only: no memory, no random init
        return {name: tuple(t.shape) for name, t in PathModel(ModelConfig(**dict(fields))).state_dict().items()}


def level_param_shapes(cfg: ModelConfig, layout: Layout, level_index: int) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of any module on one level."""
    level = layout.levels[level_index]
    return {name: shape for name, shape in _model_param_shapes(cfg).items() if level.owns(name)}


def init_level_modules(cfg: ModelConfig, layout: Layout, *, seed: int) -> list[Tensors]:
    """Initial weights of one module per level; every module of a level starts identical (paper §2.2)."""
    state = init_state(cfg, seed=seed)
    return [split_state(state, layout)[i] for i in range(len(layout.levels))]


def split_state(state: Mapping[str, torch.Tensor], layout: Layout) -> list[Tensors]:
    """Path state dict -> one tensor dict per level."""
    out: list[Tensors] = [{} for _ in layout.levels]
    for name, tensor in state.items():
        out[layout.level_of(name)][name] = tensor
    return out


def compose_state(modules: Sequence[Mapping[str, torch.Tensor]]) -> Tensors:
    """One tensor dict per level -> path state dict."""
    state: Tensors = {}
    for weights in modules:
        for name, tensor in weights.items():
            if name in state:
                raise LayoutError(f"tensor {name!r} appears in two modules of the path")
            state[name] = tensor
    return state


def build_path(cfg: ModelConfig, modules: Sequence[Mapping[str, torch.Tensor]]) -> PathModel:
    """A trainable `PathModel` loaded (strictly) from one module per level."""
    model = PathModel(cfg)
    model.load_state_dict(compose_state(modules), strict=True)
    return model
