"""The trainer's state dict, typed: what `DPTrainer.state_dict()` returns and
`DPTrainer.load_state_dict()` takes, and the pieces of it the trainer's parts do not
carry in their own state dicts (global generators, where the noise lies, the embedding
tables' job-lifetime arrays).

`cocoon_ckpt.format.codec` turns exactly this dict into a version's arrays and records
and back; nothing else builds it.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any, NotRequired, TypedDict, cast

import numpy as np
import torch

from cocoon_ckpt._state_dict import check_state
from cocoon_ckpt.errors import StoredStateError
from cocoon_ckpt.records import IdentityRecord, PlacementRecord

if TYPE_CHECKING:
    from cocoon_ckpt.dp.noise_mechanism import NoiseMechanism
    from cocoon_ckpt.embedding.csc import CoalescedCSC
    from cocoon_ckpt.embedding.csc_shards import StoredParts
    from cocoon_ckpt.embedding.csc_window import CscWindows, StoredCSC
    from cocoon_ckpt.embedding.tables import EmbeddingNoise

__all__ = [
    "TRAINER_SCHEMA",
    "NoiseLayout",
    "PartState",
    "RngState",
    "TableArrays",
    "TrainerState",
    "check_trainer_state",
    "load_parts",
    "load_rng_state",
    "load_table_arrays",
    "noise_layout",
    "part_states",
    "rng_state",
    "table_arrays",
]

#: `schema_version` of the trainer's state dict (2: global generators, layout and the
#: embedding tables' arrays joined the parts' states; 3: the LR scheduler, the job's
#: stateful parts and its identity).
TRAINER_SCHEMA = 3


class PartState(TypedDict):
    """A user part's state (an LR scheduler, a `JobParts.stateful` entry)."""

    kind: str
    """The part's qualified class name (a resume refuses another)."""
    state: Any
    """Its `state_dict()`, by reference."""


class NoiseLayout(TypedDict):
    """Where the dense noise vector comes from and where its history lies (descriptive:
    a resume re-plans it, the noise is the same bit for bit on any layout)."""

    dim: int
    """Length of the whole noise vector."""
    param_names: list[str]
    """The dense parameters, flattened in this order into the noise vector."""
    rank: int | None
    """This process's rank (None: one process)."""
    placement: list[PlacementRecord]
    """Which absolute columns of this rank's shard lie on which tier."""
    plan: dict[str, Any] | None
    """The tier plan the history was split by (None: one host tier)."""
    history_bytes: int


class RngState(TypedDict):
    """The global generators a job draws from (model initialisation, dropout, shuffles)."""

    torch: torch.Tensor
    """`torch.get_rng_state()`, (5056,) uint8."""
    numpy: tuple[Any, ...]
    """`np.random.get_state()` (legacy tuple form)."""
    python: tuple[Any, ...]
    """`random.getstate()`."""
    cuda: NotRequired[list[torch.Tensor]]
    """`torch.cuda.get_rng_state_all()`, when the process has initialised CUDA (dropout
    on a GPU draws from these)."""


class TableArrays(TypedDict):
    """An embedding table's job-lifetime arrays and sizes, beside its engine's state."""

    param: str
    rows: int
    dim: int
    online_rows: int
    """Rows whose noise is generated online (a ring); the rest is precomputed or lazy."""
    order: np.ndarray
    """(rows,) int64: the table's noise order, fixed by the sampler and the data."""
    csc: CoalescedCSC | CscWindows | StoredCSC | StoredParts | None
    """The precomputed coalesced noise (None: not coalesced, or not yet computed): in
    memory (a rank's part on several ranks), read from the store in windows, or
    committed and not read yet (a resume's; in parts when several ranks wrote it)."""
    precompute_seconds: float
    history_bytes: int


class TrainerState(TypedDict):
    """`DPTrainer.state_dict()`: the parts' own state dicts by reference to live
    tensors (copy before writing), and what the trainer itself adds."""

    kind: str
    schema_version: int
    step: int
    """Steps taken."""
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    """torch's optimizer state_dict."""
    noise: dict[str, Any]
    """`NoiseMechanism.state_dict()` of this rank's shard: its `ring` is the live
    `RingHistory` of its rows, of which a checkpoint copies only those new since its
    parent (every one, when the rows are not `persistent_rows`: a BLT's buffers)."""
    noise_layout: NoiseLayout
    sampler: dict[str, Any]
    accountant: dict[str, Any]
    """`Accountant.state_dict(with_epsilon=False)`: the writer composes the epsilon of
    the job's last version; a mid-run version keeps None."""
    mechanism: dict[str, Any]
    """`BandMF.state_dict()` or `BLT.state_dict()` (a resume compares it before loading,
    and rebuilds a BLT from it rather than fitting one again)."""
    generator: dict[str, Any]
    """The generator backend (a resume checks it before loading)."""
    rng: RngState
    embedding: dict[str, Any] | None
    """`EmbeddingNoise.state_dict()` (None: no embedding tables)."""
    embedding_tables: list[TableArrays] | None
    identity: IdentityRecord | None
    """What the job's real objects are, as built (`train.identity`); a resume compares
    it before loading. None: a version written before it was recorded."""
    scheduler: PartState | None
    """The LR scheduler's state (None: the job has none)."""
    stateful: dict[str, PartState]
    """`JobParts.stateful` by name."""


def _kind(part: object) -> str:
    cls = type(part)
    return f"{cls.__module__}.{cls.__qualname__}"


def part_states(
    scheduler: Any, stateful: dict[str, Any]
) -> tuple[PartState | None, dict[str, PartState]]:
    """The `scheduler` and `stateful` entries of the trainer's state (by reference)."""
    return (
        None if scheduler is None else {"kind": _kind(scheduler), "state": scheduler.state_dict()},
        {name: {"kind": _kind(p), "state": p.state_dict()} for name, p in stateful.items()},
    )


def check_trainer_state(state: TrainerState, scheduler: Any, stateful: dict[str, Any]) -> None:
    """Refuse a state of another kind or schema, or whose scheduler or stateful parts
    are not this job's (checked before anything is loaded).

    Raises:
        StateSchemaError: not a DPTrainer state of this schema.
        ValueError: the scheduler or the stateful parts differ, naming them.
    """
    check_state(state, "DPTrainer", TRAINER_SCHEMA)
    stored = state["scheduler"]
    if (stored is None) != (scheduler is None) or (
        stored is not None and stored["kind"] != _kind(scheduler)
    ):
        raise StoredStateError(
            f"the stored LR scheduler is {stored['kind'] if stored else None}, this job's is "
            f"{_kind(scheduler) if scheduler is not None else None}: resume with the "
            "scheduler the job started with"
        )
    mine = {n: _kind(p) for n, p in stateful.items()}
    theirs = {n: p["kind"] for n, p in state["stateful"].items()}
    if mine != theirs:
        raise StoredStateError(
            f"the stored stateful parts are {theirs}, this job's are {mine}: resume with "
            "the JobParts.stateful the job started with"
        )


def load_parts(state: TrainerState, scheduler: Any, stateful: dict[str, Any]) -> None:
    """Load the scheduler's and the stateful parts' states (checked by
    `check_trainer_state`)."""
    if scheduler is not None and state["scheduler"] is not None:
        scheduler.load_state_dict(state["scheduler"]["state"])
    for name, part in stateful.items():
        part.load_state_dict(state["stateful"][name]["state"])


def noise_layout(
    noise: NoiseMechanism, dim: int, param_names: list[str], rank: int | None
) -> NoiseLayout:
    """The layout of `noise`, this rank's shard of a `dim`-long vector."""
    placement = [
        {**p, "start": p["start"] + noise.start, "stop": p["stop"] + noise.start}
        for p in noise.state_rows.placement()
    ]
    if rank is not None:
        placement = [{**p, "rank": rank} for p in placement]
    return {
        "dim": dim,
        "param_names": list(param_names),
        "rank": rank,
        "placement": cast(list[PlacementRecord], placement),
        "plan": noise.state_rows.plan,
        "history_bytes": noise.history_bytes(),
    }


def rng_state() -> RngState:
    """The global generators' states now."""
    state: RngState = {
        "torch": torch.get_rng_state(),
        "numpy": tuple(np.random.get_state()),
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    return state


def load_rng_state(state: RngState) -> None:
    """Set the global generators to `state`."""
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    cuda = state.get("cuda")
    # without CUDA here the job resumed on another device type (allowed by its caller):
    # its gradients differ in the last bits anyway, and no GPU draws from these
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)


def table_arrays(emb: EmbeddingNoise) -> list[TableArrays]:
    """Each table's job-lifetime arrays and sizes (by reference)."""
    return [
        {
            "param": e.spec.param,
            "rows": e.rows,
            "dim": e.dim,
            "online_rows": e.online_rows,
            "order": e.order,
            "csc": e.csc,
            "precompute_seconds": e.precompute_seconds,
            "history_bytes": e.history_bytes(),
        }
        for e in emb.engines
    ]


def load_table_arrays(emb: EmbeddingNoise, tables: list[TableArrays]) -> None:
    """Check each stored noise order against this job's, and use the stored CSCs.

    Raises:
        StoredStateError: the tables differ, or a table's noise order changed.
    """
    if [t["param"] for t in tables] != [e.spec.param for e in emb.engines]:
        raise StoredStateError(
            f"stored embedding tables {[t['param'] for t in tables]} differ from this "
            f"job's {[e.spec.param for e in emb.engines]}"
        )
    for e, rec in zip(emb.engines, tables, strict=True):
        if not np.array_equal(rec["order"], e.order):
            raise StoredStateError(
                f"table {e.spec.param}: the stored noise order differs from the one this "
                "job's sampler and data give: the access schedule changed"
            )
        if rec["csc"] is not None:
            e.set_csc(rec["csc"])
        e.precompute_seconds = float(rec["precompute_seconds"])
