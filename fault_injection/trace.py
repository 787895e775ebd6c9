"""The golden-run comparator: a per-step trace of an uninterrupted run, compared step
by step with a run that was crashed and resumed, naming the first divergence."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from cocoon_ckpt import DPTrainer, JobConfig, JobOptions, StepResult, run_job
from cocoon_ckpt.train.start import Parts

from .crash import CrashPointHit, crash_at, disarm_all

__all__ = ["Divergence", "StepTrace", "Trace", "golden", "verify"]


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().numpy().tobytes()).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class StepTrace:
    """What step t did, as hashes: bit-identical runs have identical traces."""

    step: int
    batch: str
    """Hash of the sampled example ids."""
    noise: str
    """Hash of w_t."""
    params: str
    """Hash of every trainable parameter after the update."""
    accountant_steps: int
    """Steps the accountant has recorded."""


@dataclass(frozen=True, slots=True)
class Divergence:
    """The first step at which two traces differ, and in what."""

    step: int
    fields: tuple[str, ...]

    def __str__(self) -> str:
        return f"step {self.step}: {', '.join(self.fields)} differ"


@dataclass
class Trace:
    """Per-step trace; a step re-run after a resume replaces the earlier record."""

    steps: dict[int, StepTrace] = field(default_factory=dict)
    resumes: int = 0
    crashes: list[str] = field(default_factory=list)

    def record(self, res: StepResult, trainer: DPTrainer) -> None:
        if trainer.last_noise is None:
            raise RuntimeError("the trainer took no step")
        idx = torch.from_numpy(trainer.sampler.batch(res.step))
        params = torch.cat([p.detach().reshape(-1) for p in trainer._noisy.params])
        self.steps[res.step] = StepTrace(
            step=res.step,
            batch=_digest(idx),
            noise=_digest(trainer.last_noise),
            params=_digest(params),
            accountant_steps=trainer.accountant.steps,
        )

    def first_divergence(self, other: Trace) -> Divergence | None:
        """The first step where `other` differs from (or lacks) this trace's record."""
        for step in sorted(set(self.steps) | set(other.steps)):
            a, b = self.steps.get(step), other.steps.get(step)
            if a is None or b is None:
                return Divergence(step, ("missing step",))
            diff = tuple(
                f
                for f in ("batch", "noise", "params", "accountant_steps")
                if getattr(a, f) != getattr(b, f)
            )
            if diff:
                return Divergence(step, diff)
        return None


def golden(
    config: JobConfig, store_url: str, parts: Parts = None, *, options: JobOptions | None = None
) -> Trace:
    """Trace an uninterrupted run of `config` (`run_job`'s `parts` and `options`) into a
    fresh store."""
    trace = Trace()
    run_job(config, store_url, parts, options=options, on_step=trace.record)
    return trace


def verify(
    config: JobConfig,
    store_url: str,
    schedule: Sequence[tuple[str, int | None]],
    reference: Trace,
    trace: Trace | None = None,
    *,
    parts: Parts = None,
    options: JobOptions | None = None,
) -> tuple[Trace, Divergence | None]:
    """Run `config`, crashing in-process at each `(crash point, step)` of `schedule` in
    turn and resuming after each, to completion; compare with `reference`.

    `trace` continues the record of runs made before this call (a crash the caller
    caused itself); by default the record starts empty.

    Returns:
        The faulted run's trace and its first divergence from `reference` (None: the
        resumed noise, batches, parameters and accounting match bit for bit).
    """
    trace = Trace() if trace is None else trace
    for point, step in schedule:
        crash_at(point, step=step)
        try:
            run_job(config, store_url, parts, options=options, on_step=trace.record)
        except CrashPointHit as hit:
            trace.crashes.append(f"{hit.name}@{hit.ctx.get('step')}")
            trace.resumes += 1
            continue
        finally:
            disarm_all()
        break  # the job completed: later crash points can no longer fire
    else:
        run_job(config, store_url, parts, options=options, on_step=trace.record)
    return trace, reference.first_divergence(trace)
