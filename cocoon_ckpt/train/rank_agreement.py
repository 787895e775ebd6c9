"""What the ranks of a torch.distributed job agree on before anything is written: the
job each was asked to run, the store it names, the noise key it found (by `key_id`,
never the key), and the parts it built (model shapes, optimizer, scheduler, dataset).

Rank 0 alone writes, so a rank given other flags or another key would otherwise train
under rank 0's record: its noise drawn from a key the store does not name, or its
examples sampled from another seed. Each rank's values are JSON texts, one per field,
gathered on every rank in one all-gather (`DistContext.gather_checked`); every rank
compares the same gathered list the same way, which is rank 0's comparison without a
second collective. Any difference is one `RankDisagreementError` on every rank, its
message listing each differing field with each rank's value.

Compared: every field of the config record but those a rank sets for itself (where its
history lives, its threads, its log level: `PER_RANK`); the store's URL; the key each
rank would use (an existing key by its id; a new one by where it will be kept); the
model's parameter shapes and the job's identity (`train.identity`), the fingerprint's
other ingredients, compared by field rather than by digest so the message can name them.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from cocoon_ckpt.errors import ConfigError, JobError
from cocoon_ckpt.keys import key_id, load_key, read_key_file
from cocoon_ckpt.layout import KEY_SECRET
from state import Store, StoreNotFoundError

if TYPE_CHECKING:
    from cocoon_ckpt.train.config import JobConfig
    from cocoon_ckpt.train.distributed import DistContext
    from cocoon_ckpt.train.parts import JobParts

__all__ = [
    "PER_RANK",
    "RankDisagreementError",
    "agree_on",
    "agree_on_request",
    "check_coordinator_key",
    "found_key",
    "parts_values",
    "request_values",
]

#: Config fields (the last part of a dotted name) and sections each rank may set for
#: itself: where its shard of the history lives, its threads (a new job's ranks take rank
#: 0's `grad_threads`, a resume the record's), its log level. None changes the noise,
#: the sampling or the record.
PER_RANK = frozenset({"tiers", "grad_threads", "overlap_noise", "log_level"})


class RankDisagreementError(ConfigError):
    """The ranks of one job were given different flags, keys, stores or parts.

    Attributes:
        differences: one `field: rank 0 VALUE, rank 1 VALUE` line per differing field.
    """

    def __init__(self, message: str, differences: list[str]) -> None:
        super().__init__(message)
        self.differences = differences


def _flat(record: Mapping[str, Any], prefix: str, out: dict[str, str]) -> dict[str, str]:
    """Each leaf of `record` as canonical JSON text under its dotted name."""
    for k, v in record.items():
        if isinstance(v, Mapping) and v:
            _flat(v, f"{prefix}{k}.", out)
        else:
            out[f"{prefix}{k}"] = json.dumps(v, sort_keys=True)
    return out


def found_key(store: Store | None, key_file: str | None, *, resuming: bool) -> bytes | None:
    """The key a start finds without writing: a resume's own key, a key file of the
    user's, or the key a store kept before its first run died before its first commit;
    None where the job will make a new one.

    Raises:
        NoiseKeyError: the key a resume needs is missing or refused (`keys.load_key`).
    """
    if key_file is not None:
        if resuming or os.path.lexists(key_file):
            return read_key_file(key_file)
        return None
    if store is not None and (resuming or store.get_secret(KEY_SECRET) is not None):
        return load_key(store, None)
    return None


def request_values(
    config: JobConfig,
    store_url: str,
    *,
    key_file: str | None,
    storage_options: dict[str, Any] | None,
    fs: Any,
) -> dict[str, str]:
    """What this rank was asked to run, field by field: the config record (less
    `PER_RANK`), the store's URL and the key it would use. Reads the store; writes
    nothing.

    Raises:
        NoiseKeyError: a resume's key is missing or refused here.
        StoreError: the store cannot be read.
    """
    values = {
        k: v
        for k, v in _flat(config.to_record(), "", {}).items()
        if k.split(".")[0] not in PER_RANK  # top-level fields: a job option is the job's
    }
    values["store"] = store_url
    try:
        store: Store | None = Store.open(
            store_url, storage_options=storage_options, fs=fs, create=False
        )
    except StoreNotFoundError:
        store = None
    resuming = store is not None and bool(store.versions())
    key = found_key(store, key_file, resuming=resuming)
    if key is not None:
        # the same key at another path is the same key: a host's copy of the key file
        values["key"] = f"key id {key_id(key)}"
    else:
        where = f"key file {key_file}" if key_file is not None else "the store"
        values["key"] = f"a new key (rank 0 makes it) kept in {where}"
    return values


def parts_values(config: JobConfig, parts: JobParts) -> dict[str, str]:
    """What this rank built, field by field: each model state entry's shape, the device
    types of its parameters and the job's identity (optimizer, scheduler, dataset size
    and digest) as the trainer will record it. Call after `build.check_parts`."""
    # torch's modules only here: the CLI imports this module before it needs torch
    from cocoon_ckpt._state_dict import uncompiled
    from cocoon_ckpt.train.identity import job_identity
    from cocoon_ckpt.train.job_data import JobData

    if parts.dataset is None:  # JobParts sets it; keeps the type exact
        raise JobError(f"job {config.job!r}: JobParts has no dataset")
    model = uncompiled(parts.model)
    data = JobData(parts.dataset, config.dp.dataset_size, needs_tensors=bool(config.embedding))
    identity = job_identity(
        parts.optimizer, parts.scheduler, data.dataset, data.size, config.dp.seed
    )
    values = _flat({"identity": dict(identity)}, "", {})
    values.update(
        (f"model_shapes.{k}", json.dumps(list(v.shape))) for k, v in model.state_dict().items()
    )
    values["device"] = json.dumps(sorted({p.device.type for p in model.parameters()}))
    return values


def _message(differences: list[str], world: int) -> str:
    return (
        f"the {world} ranks of this job were not given the same job: "
        + "; ".join(differences)
        + ". Only rank 0's would be recorded while each rank ran its own; start every rank "
        "with the same flags, store and key file"
    )


def agree_on(dist: DistContext, compute: Callable[[], Mapping[str, str]]) -> None:
    """Every rank's `compute()` gathered and compared field by field.

    Raises:
        RankDisagreementError: a field differs between ranks (on every rank alike).
        BaseException: `compute` failed on a rank (the lowest's, on every rank).
    """
    gathered = dist.gather_checked(lambda: dict(compute()))
    fields = sorted(set().union(*gathered))
    differences = [
        f"{name}: "
        + ", ".join(f"rank {r} {values.get(name, '<absent>')}" for r, values in enumerate(gathered))
        for name in fields
        if len({values.get(name) for values in gathered}) > 1
    ]
    if differences:
        raise RankDisagreementError(_message(differences, dist.world), differences)


def _ranks() -> DistContext | None:
    """The job's ranks under torch.distributed (None: one process, torch not imported)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 and "torch.distributed" not in sys.modules:
        return None
    from cocoon_ckpt.train.distributed import DistContext

    return DistContext.from_env()


def agree_on_request(
    config: JobConfig,
    store_url: str,
    *,
    key_file: str | None,
    storage_options: dict[str, Any] | None,
    fs: Any,
) -> None:
    """Under torch.distributed, refuse on every rank a job whose ranks were asked for
    different things (`request_values`); nothing in one process. Runs before sigma is
    calibrated: a target epsilon on one rank alone would send that rank into the
    calibration's collective while the others skip it.

    Raises:
        RankDisagreementError: the ranks' requests differ (each field listed).
        NoiseKeyError, StoreError: a rank cannot read its key or the store.
    """
    dist = _ranks()
    if dist is None:
        return
    agree_on(
        dist,
        lambda: request_values(
            config, store_url, key_file=key_file, storage_options=storage_options, fs=fs
        ),
    )


def check_coordinator_key(coordinator_id: str, key: bytes, rank: int, world: int) -> None:
    """Refuse a key other than the one rank 0 started with (compared by id).

    Raises:
        RankDisagreementError: `key`'s id is not `coordinator_id`.
    """
    mine = key_id(key)
    if mine != coordinator_id:
        diff = f"key: rank 0 key id {coordinator_id}, rank {rank} key id {mine}"
        raise RankDisagreementError(_message([diff], world), [diff])
