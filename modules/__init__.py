"""The modular model and the pure DiPaCo / DiLoCo math. Knows nothing about HTTP or SQL."""

from modules.codec import (
    GRAD_CODECS,
    CodecError,
    ErrorFeedback,
    decode,
    decode_grad,
    encode,
    encode_grad,
    grad_payload_nbytes,
)
from modules.compose import build_path, compose_state, init_level_modules, level_param_shapes, split_state
from modules.config import FLAVOURS, ModelConfig, flavour
from modules.layout import Layout, LayoutError, Level, grid_layout, parse_layout
from modules.model import PathModel, init_state
from modules.outer import (
    NonFiniteStep,
    OuterConfig,
    RoundAccumulator,
    accumulate,
    alpha_weights,
    contribution_weight,
    grad_norm,
    nesterov_step,
    outer_update,
    outlier_bound,
    outlier_scales,
    pseudo_gradient,
    rescale,
    weighted_average,
)
from modules.simulate import SimulationResult, simulate
from modules.sparse_rows import expand_rows, touched_rows
from modules.train import InnerConfig, batches_from_tokens, heldout_loss, make_optimizer, train_steps

__all__ = [
    "CodecError",
    "ErrorFeedback",
    "FLAVOURS",
    "GRAD_CODECS",
    "InnerConfig",
    "Layout",
    "LayoutError",
    "Level",
    "ModelConfig",
    "NonFiniteStep",
    "OuterConfig",
    "PathModel",
    "RoundAccumulator",
    "SimulationResult",
    "accumulate",
    "alpha_weights",
    "batches_from_tokens",
    "heldout_loss",
    "build_path",
    "compose_state",
    "contribution_weight",
    "decode",
    "decode_grad",
    "encode",
    "encode_grad",
    "expand_rows",
    "flavour",
    "grad_norm",
    "grad_payload_nbytes",
    "grid_layout",
    "init_level_modules",
    "init_state",
    "level_param_shapes",
    "make_optimizer",
    "nesterov_step",
    "outlier_bound",
    "outlier_scales",
    "outer_update",
    "parse_layout",
    "pseudo_gradient",
    "rescale",
    "simulate",
    "split_state",
    "touched_rows",
    "train_steps",
    "weighted_average",
]
