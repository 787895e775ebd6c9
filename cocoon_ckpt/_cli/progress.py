"""What `train` shows while it runs, on stderr. On a terminal, tqdm bars: the embedding
precompute, then the steps with loss, the epsilon the run will have spent at its end and
the last checkpoint. Elsewhere (a batch job's log, a pipe), carriage-return redraws are
noise, so plain lines: one at the start naming the job, the store and whether it
resumes, then one per checkpoint with its step, loss, epsilon, version and seconds per
step. `train --quiet` shows neither."""

from __future__ import annotations

import queue
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Literal, TextIO

if TYPE_CHECKING:
    from cocoon_ckpt.dp.accounting.accountant import Accountant
    from cocoon_ckpt.train.trainer import DPTrainer, StepResult

__all__ = ["Progress"]

Mode = Literal["bar", "lines"]


class Progress:
    """Bars or lines fed by `run_job`'s callbacks; `close()` ends whatever is open.

    Args:
        steps: the job's total steps n (the bar's length).
        checkpoint_every: steps between checkpoints K (the job's last step is one too).
        mode: "bar" (tqdm) or "lines" (one per checkpoint); default "bar" when `stream`
            is a terminal, else "lines".
        store: the store's URL, named in the first line.
        job: the job's name (`JobConfig.job`), named in the first line.
        storage_options: fsspec options for `store`: the lines read its newest version
            number once, at the first step, to number the versions that follow.
        stream: where to write (default: stderr, so `--json` output stays alone on stdout).
    """

    def __init__(
        self,
        steps: int,
        checkpoint_every: int,
        *,
        mode: Mode | None = None,
        store: str = "",
        job: str = "",
        storage_options: dict[str, Any] | None = None,
        stream: TextIO | None = None,
    ) -> None:
        self._stream = sys.stderr if stream is None else stream
        self.mode: Mode = mode or ("bar" if self._stream.isatty() else "lines")
        self._steps = steps
        self._every = checkpoint_every
        self._store = store
        self._job = job
        self._options = storage_options
        self._bar: Any = None
        self._pre: Any = None
        self._shown = {"eps": "-", "ckpt": "-"}
        self._started = False
        self._next_version = 1
        # (steps done, monotonic time) at the last line, or at the end of the run's first
        # step: the seconds per step are timed from there, start-up excluded
        self._mark: tuple[int, float] | None = None
        self._lines: queue.Queue[tuple[str, Accountant] | None] = queue.Queue()
        self._writer: threading.Thread | None = None

    # callbacks ---------------------------------------------------------------------
    def on_precompute(self, done: int, total: int) -> None:
        """`run_job`'s on_precompute: `done` of `total` table rows precomputed (a fresh
        job only: a resume loads them from the store)."""
        if self.mode == "lines":
            if not self._started:
                self._start(resumed_at=None)
                self._print(f"precomputing the embedding noise of {total} table rows")
            if done >= total:
                self._print(f"precomputed {total} rows")
            return
        if self._pre is None:
            from tqdm import tqdm

            self._pre = tqdm(total=total, desc="precompute", unit="row", file=self._stream)
        self._pre.update(done - self._pre.n)
        if done >= total:
            self._pre.close()

    def on_step(self, res: StepResult, trainer: DPTrainer) -> None:
        """`run_job`'s on_step: `trainer` has taken one more step."""
        if self.mode == "lines":
            self._line_step(res, trainer)
            return
        if self._bar is None:  # made at the first step: a refused start draws no bar
            from tqdm import tqdm

            self._bar = tqdm(total=self._steps, desc="train", unit="step", file=self._stream)
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

    def close(self) -> None:
        """End the step bar, or write the checkpoint lines still being composed."""
        if self._bar is not None:
            self._bar.close()
        if self._writer is not None:
            self._lines.put(None)
            self._writer.join()
            self._writer = None

    # lines -------------------------------------------------------------------------
    def _start(self, resumed_at: int | None) -> None:
        """The first line, written at the first callback: by then the store is open
        and every refusal of the start is behind (a refused start prints nothing)."""
        from state import Store

        self._started = True
        # Versions are numbered newest + 1 under the writer lease this job holds.
        versions = Store.open(self._store, storage_options=self._options, create=False).versions()
        self._next_version = (versions[-1] + 1) if versions else 1
        where = f"job {self._job} on {self._store}"
        if resumed_at is None:
            what = f"a new run of {self._steps} steps"
        else:
            what = f"resuming at step {resumed_at} of {self._steps}"
        self._print(f"train: {where}: {what}, a checkpoint every {self._every} steps")

    def _line_step(self, res: StepResult, trainer: DPTrainer) -> None:
        if not self._started:
            self._start(resumed_at=res.step if res.step > 0 else None)
        done, now = trainer.step_index, time.monotonic()
        if self._mark is None:
            self._mark = (done, now)
        if done % self._every and done != self._steps:
            return
        from cocoon_ckpt.dp.accounting.accountant import Accountant

        last_step, last_time = self._mark
        timed = done - last_step
        per_step = f"{(now - last_time) / timed:.3f}" if timed else "-"
        self._mark = (done, now)
        version = self._next_version
        self._next_version += 1
        head = (
            f"step {done}/{self._steps}: loss {res.loss:.4f}, epsilon {{eps}}, "
            f"version {version}, {per_step} s/step"
        )
        # epsilon at this step is a PLD composition (tens of ms): composed off the
        # training thread, one line at a time, in order
        acc = Accountant.from_state_dict(trainer.accountant.state_dict(with_epsilon=False))
        if self._writer is None:
            self._writer = threading.Thread(
                target=self._write_lines, name="progress-lines", daemon=True
            )
            self._writer.start()
        self._lines.put((head, acc))

    def _write_lines(self) -> None:
        while (item := self._lines.get()) is not None:
            head, acc = item
            self._print(head.format(eps=f"{acc.epsilon():.3f}"))

    def _print(self, line: str) -> None:
        print(line, file=self._stream, flush=True)

    # bar ---------------------------------------------------------------------------
    def _end_epsilon(self, trainer: DPTrainer) -> None:
        """Compose the epsilon of the whole run once, on a thread of its own: mid-run
        versions no longer store theirs, and the job's last version needs this one
        (the composition is cached, so that commit finds it done)."""
        from cocoon_ckpt.dp.accounting.accountant import Accountant

        acc = Accountant.from_state_dict(trainer.accountant.state_dict(with_epsilon=False))
        acc.steps = self._steps

        def compose() -> None:
            self._shown["eps"] = f"{acc.epsilon():.3f}"

        threading.Thread(target=compose, name="progress-epsilon", daemon=True).start()
