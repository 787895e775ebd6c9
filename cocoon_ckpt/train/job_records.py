"""The records a job adds to every version (config, fingerprint, model shapes, key id,
key location, threat model, completeness, gradient thread count), built in one place and
required of every write.

A version without them is half-readable: `export` cannot decide "finished", `inspect`
shows no job, a resume cannot check the config or the key. So a writer either carries
them all or is refused before anything is written.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NotRequired, get_origin, get_type_hints

from cocoon_ckpt.errors import RequestError
from cocoon_ckpt.keys import key_id, key_location
from cocoon_ckpt.records import JobRecords
from cocoon_ckpt.train import config as cfgmod
from cocoon_ckpt.train.build import model_shapes, threat_model
from cocoon_ckpt.train.config import JobConfig
from cocoon_ckpt.train.trainer import DPTrainer

__all__ = ["REQUIRED", "IncompleteRecordsError", "check_job_records", "job_records"]

#: Every record a version of a job must carry, besides the trainer's own state: the
#: keys of `JobRecords` not marked NotRequired, read from the resolved hints because
#: `records` is written with postponed annotations, under which Python 3.11's TypedDict
#: counts every key, NotRequired ones included, in `__required_keys__`.
REQUIRED: tuple[str, ...] = tuple(
    sorted(
        name
        for name, hint in get_type_hints(JobRecords, include_extras=True).items()
        if get_origin(hint) is not NotRequired
    )
)


class IncompleteRecordsError(RequestError, ValueError):
    """A checkpoint was asked to write a version without the job's records."""


def job_records(
    config: JobConfig, trainer: DPTrainer, key: bytes, key_file: str | None
) -> JobRecords:
    """The job records of `trainer` running `config` with `key` (kept in `key_file`, or
    in the store when None); `complete` starts False and is set per version."""
    record = config.to_record()
    shapes = model_shapes(trainer)
    return {
        "config": record,
        "fingerprint": cfgmod.fingerprint(record, shapes, dict(trainer.identity)),
        "model_shapes": shapes,
        "key_id": key_id(key),
        "key_location": key_location(key_file),
        "threat_model": threat_model(config),
        "complete": False,
        # a resume restores it (train.grad_threads); not fingerprinted, so not refused
        "grad_threads": trainer.grad_threads,
    }


def check_job_records(records: Mapping[str, Any]) -> None:
    """Refuse a version that would lack a job record.

    Raises:
        IncompleteRecordsError: one or more of `REQUIRED` is absent.
    """
    missing = [name for name in REQUIRED if name not in records]
    if missing:
        raise IncompleteRecordsError(
            f"checkpoint records {', '.join(missing)} are missing, so export, inspect and "
            "resume could not read the version; open the job with cocoon_ckpt.open_job "
            "(or pass cocoon_ckpt.train.job_records.job_records(...) as extra_records)"
        )
