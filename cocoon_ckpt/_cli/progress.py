"""The progress bars of `train` on stderr: the embedding precompute, then the steps with
loss, epsilon and the last checkpoint. Only on a terminal: redirected to a file or a
pipe (a batch job's log), carriage-return redraws are noise, so nothing is drawn."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cocoon_ckpt.train.trainer import DPTrainer, StepResult

__all__ = ["Progress"]


class Progress:
    """tqdm bars fed by `run_job`'s callbacks; `close()` ends whichever is open.

    Args:
        steps: the job's total steps n (the bar's length).
        checkpoint_every: steps between checkpoints K, to show the last one.
        enabled: draw the bars (default: when stderr is a terminal).
    """

    def __init__(self, steps: int, checkpoint_every: int, *, enabled: bool | None = None) -> None:
        from tqdm import tqdm

        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self._tqdm = tqdm
        self._steps = steps
        self._every = checkpoint_every
        self._bar: Any = None
        self._pre: Any = None
        self._shown = {"eps": "-", "ckpt": "-"}

    def on_precompute(self, done: int, total: int) -> None:
        """`run_job`'s on_precompute: `done` of `total` table rows precomputed."""
        if not self.enabled:
            return
        if self._pre is None:
            self._pre = self._tqdm(total=total, desc="precompute", unit="row", file=sys.stderr)
        self._pre.update(done - self._pre.n)
        if done >= total:
            self._pre.close()

    def on_step(self, res: StepResult, trainer: DPTrainer) -> None:
        """`run_job`'s on_step: `trainer` has taken one more step."""
        if not self.enabled:
            return
        if self._bar is None:  # made at the first step: a refused start draws no bar
            self._bar = self._tqdm(total=self._steps, desc="train", unit="step", file=sys.stderr)
            self._bar.update(res.step)  # resumed: start the bar where the job is
        if trainer.step_index % self._every == 0:
            self._shown["ckpt"] = str(trainer.step_index)
        # never composes here: the checkpoint writer does, off the training thread
        eps = trainer.accountant.known_epsilon()
        if eps is not None:
            self._shown["eps"] = f"{eps:.3f}"
        self._bar.set_postfix(
            loss=f"{res.loss:.4f}",
            eps=self._shown["eps"],
            last_ckpt=self._shown["ckpt"],
            refresh=False,
        )
        self._bar.update(1)

    def close(self) -> None:
        """End the step bar, if one was drawn."""
        if self._bar is not None:
            self._bar.close()
