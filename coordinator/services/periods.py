"""Async levels' periods and the end of a run (see `modules.asynchrony` for the rules).

An async module fills a period with accepted contributions (`uploads._assign_steps`); a full period becomes a
`ModuleStep` that any apply executor takes, in period order per module. When no more contributions will come
(an all-async run whose paths all spent their budget, or a hybrid run's last round closing), partly filled
periods become steps too (`flush_periods`). A run finishes when its work is done and no step is left
(`finish_if_done`), in the transaction of its last upload or step.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from coordinator.models import Module, ModuleStep, Path, Run
from coordinator.states import RunStatus, StepStatus


def make_due(
    session: Session, module: Module, *, claimer: str | None = None, now: datetime | None = None
) -> ModuleStep:
    """The module's filling period becomes a step for the executors (the row is locked by the caller); the next
    period starts empty. Returns the step (its id once flushed).

    With `claimer` (an apply executor of the calling process) and no earlier step of the module left (its
    version has caught up with its period), the step is claimed by that executor at once, in the caller's
    transaction (`running`, one attempt, claimed at `now`): the caller hands it over after its commit
    (`RoundCloser.hand`), so no claim transaction stands between the upload and the step. Should the
    process die first, the claim is taken back like any other (`apply.release_dead_claims`, or once stale)."""
    step = ModuleStep(run_id=module.run_id, round=module.period, module_id=module.id, status=StepStatus.PENDING)
    step.attempts = 0
    if claimer is not None and module.version == module.period:
        assert now is not None
        step.status, step.claimed_by, step.claimed_at, step.attempts = StepStatus.RUNNING, claimer, now, 1
    session.add(step)
    module.period += 1
    module.period_count = 0
    return step


def budget_spent(session: Session, run: Run) -> bool:
    """Whether every path of an all-async run has trained its budget (num_rounds x inner_steps steps)."""
    short = session.scalar(
        select(Path.id).where(Path.run_id == run.id, Path.steps_done < run.num_rounds * run.inner_steps).limit(1)
    )
    return short is None


def flush_periods(session: Session, run: Run) -> int:
    """No more contributions will come: every async module with a partly filled period steps on what it has.
    Returns how many steps were made due."""
    due = 0
    for module in session.scalars(
        select(Module)
        .where(Module.run_id == run.id, Module.period_size.is_not(None), Module.period_count > 0)
        .order_by(Module.id)
        .with_for_update()
    ):
        make_due(session, module)
        due += 1
    return due


def finish_if_done(session: Session, run: Run) -> bool:
    """Mark the run finished (the caller commits) when its work is done (all-async: every path's budget spent;
    otherwise: past its last round) and no module step is left; returns whether it did."""
    done = budget_spent(session, run) if run.schedule == "async" else run.current_round >= run.num_rounds
    if not done:
        return False
    left = session.scalar(
        select(ModuleStep.id).where(ModuleStep.run_id == run.id, ModuleStep.status != StepStatus.DONE).limit(1)
    )
    if left is not None:
        return False
    run.status = RunStatus.FINISHED
    return True
