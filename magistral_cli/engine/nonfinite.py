"""What a step with a non-finite loss or gradient norm does: stop the run (exit 1), or with
``training.skip_nonfinite_steps`` skip its update, up to ``SKIP_LIMIT`` such steps in a row."""

from __future__ import annotations

import logging

from magistral_cli.errors import CheckFailed

log = logging.getLogger("magistral_cli.engine")

#: With ``training.skip_nonfinite_steps``, a run stops (exit 1) once this many steps in a row
#: were skipped, or every step of a run shorter than that: its updates have stopped (weights that
#: a skipped step does not change stay non-finite for every batch), and a run that goes on would
#: only save the unchanged model as if it had trained.
SKIP_LIMIT = 10


class NonFiniteSteps:
    """The steps skipped in this launch (``skipped``), in a row now (``streak``), and the last step
    whose update was applied (``last_applied``); the trainer reports each step's outcome."""

    def __init__(self, skip: bool, rank: int):
        self.skip = skip  # training.skip_nonfinite_steps
        self.rank = rank
        self.skipped = self.streak = self.last_applied = 0
        self.limit = SKIP_LIMIT

    def limit_run(self, steps: int) -> None:
        """A run of ``steps`` more steps stops at SKIP_LIMIT skips in a row, or when all of its steps are."""
        self.limit = max(1, min(SKIP_LIMIT, steps))

    def applied(self, step: int) -> None:
        """``step``'s update was applied."""
        self.streak, self.last_applied = 0, step

    def not_finite(self, step: int, grad_norm: float, loss_sum: float, lr: float) -> None:
        """Stop the run at a non-finite step (exit 1), or log it when ``training.skip_nonfinite_steps``."""
        what = f"step {step}: loss sum {loss_sum}, gradient norm {grad_norm} (lr {lr:g})"
        if not self.skip:
            raise CheckFailed(
                f"{what} is not finite; the update was not applied and no checkpoint was written after it. "
                "Lower training.lr or check the data; training.skip_nonfinite_steps=true skips such steps instead"
            )
        self.skipped += 1
        self.streak += 1
        if self.rank == 0:
            log.warning("%s is not finite: update skipped (training.skip_nonfinite_steps)", what)
        if self.streak >= self.limit:  # the same on every rank: the values are all-reduced
            first = step - self.streak + 1
            last = self.last_applied
            raise CheckFailed(
                f"steps {first}-{step}: {self.streak} steps in a row had a non-finite loss or gradient norm "
                "and were skipped (training.skip_nonfinite_steps), so the run stopped: the model has not changed "
                f"since step {last} ({'its last applied update' if last else 'the weights it started from'}) "
                "and no checkpoint was written after that step. Lower training.lr or check the data and "
                "training.load, then launch again: the run resumes from its last checkpoint"
            )
