"""The torch intra-op thread count a job takes its gradients at, fixed for its life.

torch's CPU GEMMs (`aten.mm`, `aten.bmm`) pick their kernel by the thread count as well
as the row count: measured on this 2-core machine, the digits MLP's per-sample gradients
at 1 and 2 threads differ in the last bits for batches of 5-7 and 9-11 examples
(float32), the DLRM example's float64 chunks at 4-35 and 511 rows, and at 3, 4 or 8
threads more sizes differ from 2. A Poisson batch can be any size, so a job's
parameters depend on the count its gradients ran at (its noise does not: it is keyed
and thread-invariant). A job therefore fixes the count when it starts, records it in
every version (record `grad_threads`, checksummed like every record, but not in the
fingerprint: a resume on another machine size is not refused) and a resume takes its
gradients at the recorded count whatever the machine's default
(`embedding.one_thread.fixed_threads` switches it around that part of the step).

The count a new job takes when none is asked for (`default_grad_threads`): one thread
when the model has fewer than `ONE_THREAD_BELOW` dense parameters (those the per-sample
gradients form, the dense dimension m: embedding tables' per-row gradients are not
counted), torch's count otherwise. Measured on the 2-core development machine, loaded by
others (bench/grad_threads.py, docs/benchmarks.md): up to 2 x 10^5 dense parameters one
thread took 0.04-0.7x the wall time and CPU time of two (the mlp example, digits,
DLRM's dense part: torch's parallel regions wait on a descheduled second thread at every
small op); from ~5 x 10^5 up the two tie in CPU time and either wins the wall clock,
so there torch's count stays. The rule's input (m, the noise record's `dim`) and its outcome
(`grad_threads`) are recorded in every version, and a resume takes the recorded count,
never the rule again: a store written under another rule or default keeps its count.
"""

from __future__ import annotations

import logging

import torch

from cocoon_ckpt.errors import ConfigError, ConfigMismatchError, StoredStateError

__all__ = [
    "ONE_THREAD_BELOW",
    "default_grad_threads",
    "resolve_grad_threads",
    "resumed_grad_threads",
]

log = logging.getLogger(__name__)


#: A new job with fewer dense parameters than this takes its gradients on one thread
#: (`default_grad_threads`); 2^18, between the largest model measured faster and cheaper
#: on one thread (204,804: the mlp example at hidden 8192) and the smallest where it was
#: not always (534,032: a 2-block transformer, d 128).
ONE_THREAD_BELOW = 1 << 18


def default_grad_threads(dense_params: int) -> int:
    """The count a new job takes when none is asked for: 1 below `ONE_THREAD_BELOW` dense
    parameters (`dense_params`, the trainer's m), torch's count now otherwise."""
    return 1 if dense_params < ONE_THREAD_BELOW else torch.get_num_threads()


def resolve_grad_threads(requested: int | None, dense_params: int) -> int:
    """A new job's gradient thread count: `requested`, or `default_grad_threads`.

    Args:
        requested: the count asked for (`JobConfig.grad_threads`); None: the default.
        dense_params: the parameters the per-sample gradients form (the trainer's m).

    Raises:
        ValueError: `requested` is not an int >= 1.
    """
    if requested is None:
        return default_grad_threads(dense_params)
    if type(requested) is not int or requested < 1:
        raise ConfigError(
            f"grad_threads={requested!r} must be an int >= 1 (torch intra-op threads for "
            "the per-sample gradients), or None for torch's current count"
        )
    return requested


def resumed_grad_threads(stored: object, requested: int | None, where: str) -> int | None:
    """The count a resumed job takes its gradients at.

    Args:
        stored: the version's `grad_threads` record (None: written before it existed).
        requested: what the resuming job asked for (None: take the stored count).
        where: the store and version, for messages.

    Returns:
        The stored count, or, for a version written before the record, `requested`, or
        else torch's count now: the count such a job ran at, as `default_grad_threads`
        did not exist then (recorded from then on). None: keep the trainer's count.

    Raises:
        ConfigMismatchError: `requested` is not the stored count.
        ValueError: the record is not an int >= 1 (a damaged version).
    """
    if stored is None:
        return None if requested is not None else torch.get_num_threads()
    if type(stored) is not int or stored < 1:
        raise StoredStateError(f"record grad_threads={stored!r} is not an int >= 1")
    if requested is not None and requested != stored:
        raise ConfigMismatchError(
            f"{where} took its gradients at grad_threads={stored}, this job asks for "
            f"grad_threads={requested}; the parameters would stop being bit-identical to "
            f"an uninterrupted run. Resume with grad_threads=None (or {stored})",
            [f"grad_threads: stored {stored}, now {requested}"],
        )
    now = torch.get_num_threads()
    if stored != now:
        log.info(
            "%s: gradients run at the job's recorded %d torch threads (this process "
            "defaults to %d), so the resumed job stays bit-identical",
            where,
            stored,
            now,
        )
    return stored
