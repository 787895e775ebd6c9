"""The trainer of a job: its parts built from the config, and what versions record
about it (threat model, model shapes)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Dataset

from cocoon_ckpt._state_dict import uncompiled
from cocoon_ckpt.dp.sampler import CyclicPoissonSampler
from cocoon_ckpt.embedding.config import EmbeddingConfig
from cocoon_ckpt.embedding.engine import TablePlan
from cocoon_ckpt.errors import ConfigError, JobError
from cocoon_ckpt.format.part_state import encode_part_state
from cocoon_ckpt.layout import SCHEDULER_PREFIX, THREAT_MODEL_DEFAULT, stateful_prefix
from cocoon_ckpt.records import ModelShapes
from cocoon_ckpt.train.config import JobConfig
from cocoon_ckpt.train.distributed import DistContext
from cocoon_ckpt.train.identity import check_config_optimizer
from cocoon_ckpt.train.job_data import JobData
from cocoon_ckpt.train.mechanisms import Mechanism, build_mechanism, mechanism_from_state
from cocoon_ckpt.train.model_checks import checked_model
from cocoon_ckpt.train.parts import JobParts, check_optimizer_step, optimizer_class, resolve
from cocoon_ckpt.train.trainer import DPTrainer

__all__ = [
    "CheckedParts",
    "build_trainer",
    "check_first_batch",
    "check_part_states",
    "check_parts",
    "checked_parts",
    "job_parts",
    "model_shapes",
    "rank0_mechanism",
    "threat_model",
]


@dataclass(frozen=True, slots=True)
class CheckedParts:
    """A job's parts that passed `check_parts` for its config: what a start builds and
    checks once, on one rank or many, and hands to the trainer (which then does not check
    them again)."""

    parts: JobParts


def checked_parts(config: JobConfig, builder: Callable[..., JobParts] | None) -> CheckedParts:
    """The job's parts, built once (`job_parts`) and checked (`check_parts`).

    Raises:
        As `job_parts` and `check_parts`.
    """
    parts = job_parts(config, builder)
    check_parts(config, parts)
    return CheckedParts(parts)


def build_trainer(
    config: JobConfig,
    key: bytes,
    builder: Callable[..., JobParts] | CheckedParts | None = None,
    table_plans: dict[str, TablePlan] | None = None,
    dist: DistContext | None = None,
    mechanism: Mechanism | None = None,
) -> DPTrainer:
    """The trainer of a job (`builder`: the parts' builder, None resolving `config.job`,
    or parts a start checked already; `table_plans`: the embedding plans a resume must
    keep; `mechanism`: the strategy a resume must keep, a stored BLT; None: built from
    the config).

    Raises:
        JobError: the builder does not take (config) or does not return JobParts.
        ConfigError, UnsupportedModelError: a part is refused (`check_parts`).
    """
    checked = builder if isinstance(builder, CheckedParts) else checked_parts(config, builder)
    parts = checked.parts
    if dist is not None:
        mechanism = rank0_mechanism(config, dist, mechanism)
    return DPTrainer(
        parts.model,
        parts.optimizer,
        parts.loss_fn,
        _dataset(config, parts),
        config.dp,
        key,
        mechanism=mechanism,
        tiers=config.tiers,
        embedding=_embedding(config, parts),
        table_plans=table_plans,
        dist=dist,
        overlap_noise=config.overlap_noise,
        grad_threads=config.grad_threads,
        scheduler=parts.scheduler,
        stateful=parts.stateful,
        num_workers=parts.num_workers,
        pin_memory=parts.pin_memory,
        collate_fn=parts.collate_fn,
        worker_timeout_s=parts.worker_timeout_s,
    )


def job_parts(config: JobConfig, builder: Callable[..., JobParts] | None) -> JobParts:
    """The job's parts: `builder(config)` (None: `config.job` resolved), called once.

    Raises:
        JobError: the builder does not take (config) or does not return JobParts.
    """
    build = builder or resolve(config.job)
    try:
        parts = build(config)
    except TypeError as exc:
        if exc.__traceback__ is not None and exc.__traceback__.tb_next is None:
            # raised by the call itself, not inside the builder: a wrong signature
            raise JobError(
                f"job {config.job!r}: the builder must be a function of one argument, the "
                f"JobConfig, returning JobParts ({exc})"
            ) from None
        raise
    if not isinstance(parts, JobParts):
        raise JobError(
            f"job {config.job!r}: the builder returned {type(parts).__name__}, not JobParts"
        )
    return parts


def check_parts(config: JobConfig, parts: JobParts) -> None:
    """The refusals of the job's parts that need no key, in one place for one rank and
    many: a start runs them once, before anything is written (`start.start_job`; on
    every rank of a multi-process job), and `build_trainer` runs them for parts no start
    checked. The model's and scheduler's are `model_checks.checked_model`, the one home
    `DPTrainer` is built from.

    The mechanism checks (`mechanisms.check_mechanism`) are not run: a mechanism built
    from a valid config passes them (JobConfig refuses a BLT with embedding tables), and
    a resume's stored one is checked when each rank builds its trainer, a refusal agreed
    across ranks (`start.trainer_on_ranks`).

    Raises:
        ConfigError: `config.optimizer` names a torch optimizer whose step needs a
            closure (lbfgs), the optimizer is not the one `config.optimizer`/`lr` name, the
            dataset's size is not `config.dp.dataset_size`, embedding noise is given
            data other than tensors or a `noise_rng` other than default, or the model's
            trainable parameters lie on several devices.
        UnsupportedModelError: a BatchNorm in training mode, or trainable parameters
            not float32/float64.
        ValueError: embedding noise with no table named; a table is not a parameter.
    """
    if config.optimizer != "custom":  # named before the job's objects are compared with it
        name = config.optimizer
        check_optimizer_step(optimizer_class(name), f"JobConfig.optimizer={name!r}")
    check_config_optimizer(parts.optimizer, config.optimizer, config.lr, parts.scheduler)
    check_optimizer_step(parts.optimizer, "JobParts.optimizer")
    check_part_states(parts)
    # the trainer's own data and model checks, run without the trainer
    check_first_batch(config, parts)
    model = uncompiled(parts.model)
    checked_model(model, parts.loss_fn, config.dp, _embedding(config, parts), parts.scheduler)


def check_first_batch(config: JobConfig, parts: JobParts) -> None:
    """Draw, collate and check step 0's batch as the trainer will (in this process, with
    the job's collate_fn), before anything is written: a Dataset whose items collate to
    anything but a tuple of tensors, inputs then the target, is refused at start and not
    at step 0 after the store, key and lease were created. The global generators are as
    before (the draw seeds and restores them, `train.data`).

    Raises:
        ConfigError: the dataset's size is not `config.dp.dataset_size`, embedding noise
            is given other data than tensors, or the batch is not a tuple of at least two
            tensors stacked along dim 0; naming what the Dataset must return.
    """
    data = JobData(
        _dataset(config, parts),
        config.dp.dataset_size,
        needs_tensors=bool(config.embedding),
        collate_fn=parts.collate_fn,
    )
    sampler = CyclicPoissonSampler(
        dataset_size=config.dp.dataset_size,
        batch_size=config.dp.batch_size,
        bands=config.dp.bands,
        seed=config.dp.seed,
    )
    what = f"the job's dataset ({type(data.dataset).__name__})"
    try:
        batch = data.draw(sampler, 0, None)
    except (TypeError, ValueError) as exc:
        if not _raised_in(exc, os.path.dirname(torch.__file__ or ""), _PACKAGE):
            raise  # the user's __getitem__ or collate_fn failed: their error, their line
        raise ConfigError(f"{what}: {exc}") from None
    if len(batch.tensors) < 2:
        raise ConfigError(
            f"{what}: its items collate to {len(batch.tensors)} tensor(s); a Dataset item "
            "must be a tuple (inputs..., target) of tensors, or numbers: the last is the "
            "loss's target"
        )


# cocoon_ckpt's own folder, found from this file rather than by importing the package
# (train sits below the package's __init__, which imports train)
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _raised_in(exc: BaseException, *folders: str) -> bool:
    """Whether the innermost frame of `exc`'s traceback is in one of `folders`."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return False
    where = os.path.realpath(tb.tb_frame.f_code.co_filename)
    roots = (os.path.realpath(f) + os.sep for f in folders)
    return any(where.startswith(r) for r in roots)


def check_part_states(parts: JobParts) -> None:
    """Refuse a scheduler or stateful part whose `state_dict()` no version could hold
    (another type than the part-state grammar's, nested deeper than
    `part_state.MAX_PART_DEPTH`) now, before anything is written, not at the first
    checkpoint.

    Raises:
        ConfigError: naming the part and what in its state is refused.
    """
    named: dict[str, Any] = {} if parts.scheduler is None else {SCHEDULER_PREFIX: parts.scheduler}
    named.update({stateful_prefix(name): part for name, part in parts.stateful.items()})
    for prefix, part in named.items():
        try:
            encode_part_state(part.state_dict(), prefix, None)  # checks, copies nothing
        except TypeError as exc:
            raise ConfigError(
                f"{type(part).__name__}.state_dict() of the job's {prefix}: {exc}"
            ) from None


def _embedding(config: JobConfig, parts: JobParts) -> EmbeddingConfig | None:
    """The job's embedding config, naming the tables the job declares where it names none."""
    emb = config.embedding
    if emb is not None and not emb.tables:
        emb = dataclasses.replace(emb, tables=tuple(parts.tables))
    return emb


def _dataset(config: JobConfig, parts: JobParts) -> Dataset[Any] | Sequence[torch.Tensor]:
    if parts.dataset is None:  # JobParts sets it; keeps the type exact
        raise JobError(f"job {config.job!r}: JobParts has no dataset")
    return parts.dataset


def rank0_mechanism(config: JobConfig, dist: DistContext, mechanism: Mechanism | None) -> Mechanism:
    """The coordinator's mechanism (`mechanism`, or built from the config), on every rank.

    Each rank computes its slice of w_t from the strategy it holds, and the version
    records the coordinator's: a fit run on every rank may differ in its last bits on
    another host (BLAS, libm), so one fit is broadcast. On one host it also spares the
    other ranks a BLT fit (seconds of CPU each) that would give the same bits.

    Raises:
        BaseException: whatever building it raised on the coordinator, raised on every
            rank as the coordinator raised it (none hangs, all exit alike).
    """
    built: list[Mechanism] = []

    def build() -> dict[str, Any]:
        built.append(mechanism or build_mechanism(config.dp))
        return built[0].state_dict()

    state = dist.from_coordinator(build)
    return built[0] if built else mechanism_from_state(state)


def threat_model(config: JobConfig) -> str:
    """The threat model a job's versions carry (`layout.THREAT_MODELS`)."""
    return config.embedding.threat_model if config.embedding else THREAT_MODEL_DEFAULT


def model_shapes(trainer: DPTrainer) -> ModelShapes:
    """Each model state_dict entry's shape (the `model_shapes` record)."""
    return {k: list(v.shape) for k, v in trainer.model.state_dict().items()}
