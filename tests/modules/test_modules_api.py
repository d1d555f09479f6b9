"""Pins the public surface of `modules`: other packages import these names (never remove or rename one)."""

from __future__ import annotations

import modules

PUBLIC = {
    "AsyncResult",
    "AsyncSettings",
    "FLAVOURS",
    "GRAD_CODECS",
    "CodecError",
    "ErrorFeedback",
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
    "all_finite",
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
    "outer_update",
    "outlier_bound",
    "outlier_scales",
    "parse_layout",
    "pseudo_gradient",
    "rescale",
    "simulate",
    "simulate_async",
    "split_state",
    "touched_rows",
    "train_steps",
    "weighted_average",
}


def test_public_surface() -> None:
    assert set(modules.__all__) == PUBLIC
    for name in PUBLIC:
        assert hasattr(modules, name), name


def test_the_async_reference_is_reachable_from_simulate_and_the_package() -> None:
    """One reference module for both schedules: `modules.simulate` re-exports the async replay. (The package's
    attribute `simulate` is the round function, so the module is reached by import, not as `modules.simulate.x`.)"""
    from modules import asynchrony
    from modules.simulate import AsyncSettings, Lease, Upload, simulate_async

    assert simulate_async is asynchrony.simulate_async is modules.simulate_async
    assert (AsyncSettings, Lease, Upload) == (asynchrony.AsyncSettings, asynchrony.Lease, asynchrony.Upload)
    assert modules.AsyncSettings is asynchrony.AsyncSettings
