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
    OuterConfig,
    accumulate,
    alpha_weights,
    nesterov_step,
    outer_update,
    pseudo_gradient,
    rescale,
    weighted_average,
)
from modules.simulate import SimulationResult, simulate
from modules.train import InnerConfig, batches_from_tokens, make_optimizer, train_steps

__all__ = [
    "FLAVOURS", "CodecError", "InnerConfig", "Layout", "LayoutError", "Level", "ModelConfig", "OuterConfig",
    "PathModel", "accumulate", "batches_from_tokens", "build_path", "compose_state", "decode", "encode",
    "flavour", "grid_layout", "init_level_modules", "init_state", "level_param_shapes", "make_optimizer",
    "nesterov_step", "parse_layout", "pseudo_gradient", "split_state", "train_steps", "weighted_average",
    # added for issue 3
    "GRAD_CODECS", "ErrorFeedback", "SimulationResult", "alpha_weights", "decode_grad", "encode_grad",
    "grad_payload_nbytes", "outer_update", "rescale", "simulate",
]
