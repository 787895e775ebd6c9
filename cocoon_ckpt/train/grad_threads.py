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
"""

from __future__ import annotations

import logging

import torch

from cocoon_ckpt.errors import ConfigError, ConfigMismatchError, StoredStateError

__all__ = ["resolve_grad_threads", "resumed_grad_threads"]

log = logging.getLogger(__name__)


def resolve_grad_threads(requested: int | None) -> int:
    """A new job's gradient thread count: `requested`, or torch's count now.

    Raises:
        ValueError: `requested` is not an int >= 1.
    """
    if requested is None:
        return torch.get_num_threads()
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
        The stored count, or None when the version has none (the job keeps the count it
        was built with, as before the record, and records it from then on).

    Raises:
        ConfigMismatchError: `requested` is not the stored count.
        ValueError: the record is not an int >= 1 (a damaged version).
    """
    if stored is None:
        return None
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
