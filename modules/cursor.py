"""A path's data cursor: where its next lease's token range lies in its shard.

A range of H inner steps is H x B x T + 1 tokens (B = inner.batch_size, T = seq_len: the last target token of a
range is the next range's first input), and a range never crosses the end of the shard. Two rules for a range
that does not fit in the rest of the shard:

Round leases (`next_range`)
    start the next epoch at token 0: the tail is left out. Their H is the round's (every path trains H steps a
    round, and the round reference `modules.simulate` is the run bit for bit).
Async leases (`fitting_steps`)
    whose H is their own already (dynamic local updates, the budget's last lease), take the tail with as many
    whole steps as fit when that is at least the run's `min_inner_steps` (1 when unset), else start the next
    epoch. So an epoch leaves out less than `min_inner_steps` steps' tokens (less than one step's without dynamic
    H) instead of up to a whole lease's, and with a fixed H the tail is trained too.
"""

from __future__ import annotations


def next_range(offset: int, *, length: int, steps: int, batch_size: int, seq_len: int) -> tuple[int, int]:
    """(start of this round's range, next offset) of a path cursor; wraps to 0 when the range won't fit."""
    stride = steps * batch_size * seq_len
    if stride + 1 > length:
        raise ValueError(f"token array of {length} tokens is shorter than one round's {stride + 1}")
    start = 0 if offset + stride + 1 > length else offset
    return start, start + stride


def fitting_steps(offset: int, *, length: int, steps: int, per_step: int, min_steps: int | None) -> int:
    """Inner steps of an async lease of `steps` from `offset` in a shard of `length` tokens (`per_step` = B x T
    tokens a step): `steps` when its range fits in the rest of the shard, else the whole steps that fit (the
    tail) when they are at least `min_steps` (None: 1), else 0: the lease starts the next epoch."""
    fit = max(0, (length - offset - 1) // per_step)
    if steps <= fit:
        return steps
    return fit if fit >= max(1, min_steps or 1) else 0
