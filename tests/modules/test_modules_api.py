"""Pins the public surface of `modules`: other packages import these names (never remove or rename one)."""

from __future__ import annotations

import modules

PUBLIC = {
    # the lead's original surface
    "FLAVOURS", "CodecError", "InnerConfig", "Layout", "LayoutError", "Level", "ModelConfig", "OuterConfig",
    "PathModel", "accumulate", "batches_from_tokens", "build_path", "compose_state", "decode", "encode",
    "flavour", "grid_layout", "init_level_modules", "init_state", "level_param_shapes", "make_optimizer",
    "nesterov_step", "parse_layout", "pseudo_gradient", "split_state", "train_steps", "weighted_average",
    # issue 3
    "GRAD_CODECS", "ErrorFeedback", "SimulationResult", "alpha_weights", "decode_grad", "encode_grad",
    "grad_payload_nbytes", "outer_update", "rescale", "simulate",
}


def test_public_surface() -> None:
    assert set(modules.__all__) == PUBLIC
    for name in PUBLIC:
        assert hasattr(modules, name), name
