"""The progress bars of `train` on stderr: the embedding precompute, then the steps with
loss, the epsilon the run will have spent at its end, and the last checkpoint. Only on
a terminal: redirected to a file or a pipe (a batch job's log), carriage-return
redraws are noise, so nothing is drawn."""

from __future__ import annotations

import sys
import threading
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
            self._end_epsilon(trainer)
        if trainer.step_index % self._every == 0:
            self._shown["ckpt"] = str(trainer.step_index)
        self._bar.set_postfix(
            loss=f"{res.loss:.4f}",
            eps_at_end=self._shown["eps"],
            last_ckpt=self._shown["ckpt"],
            refresh=False,
        )
        self._bar.update(1)

    def _end_epsilon(self, trainer: DPTrainer) -> None:
        """Compose the epsilon of the whole run once, on a thread of its own: mid-run
        versions no longer store theirs, and the job's last version needs this one
        (the composition is cached, so that commit finds it done)."""
        from cocoon_ckpt.dp.accountant import Accountant

        acc = Accountant.from_state_dict(trainer.accountant.state_dict(with_epsilon=False))
        acc.steps = self._steps

        def compose() -> None:
            self._shown["eps"] = f"{acc.epsilon():.3f}"

        threading.Thread(target=compose, name="progress-epsilon", daemon=True).start()

    def close(self) -> None:
        """End the step bar, if one was drawn."""
        if self._bar is not None:
            self._bar.close()
