"""The typed schema of a version's manifest records: one TypedDict per record name.

A version's manifest holds small JSON records beside its arrays (docs/store-format.md).
The snapshot codec (`cocoon_ckpt.format.codec`) writes them and every reader (resume,
audit, inspect, export, plots) reads them through these types, so the keys have one
definition. `VersionRecords` lists every record by its name in the manifest; a record
marked `NotRequired` is absent from stores written before it existed, so readers use
`.get` for it.

Parts' own state dicts (sampler, accountant, mechanism) are stored as they are: their
types here name the keys the part's `state_dict()` returns. Nothing here imports torch
or numpy: `inspect` reads these types torch-free.
"""

from __future__ import annotations

from typing import Any, Literal, NotRequired, TypeAlias, TypedDict

__all__ = [
    "AccountantRecord",
    "CscPartRecord",
    "CscRecord",
    "DatasetIdentity",
    "DeviceIdentity",
    "EmbeddingRecord",
    "GeneratorRecord",
    "IdentityRecord",
    "JobRecords",
    "MechanismRecord",
    "BLTRecord",
    "MetricSeries",
    "MetricsRecord",
    "ModelShapes",
    "NoiseRecord",
    "NumpyRngRecord",
    "OptimizerIdentity",
    "OptimizerRecord",
    "OptimizerValue",
    "PackedArrayRecord",
    "PartStateRecord",
    "PlacementRecord",
    "PythonRngRecord",
    "RankShard",
    "RingSlot",
    "RngRecord",
    "SamplerRecord",
    "SchedulerIdentity",
    "ShardRecord",
    "SnapshotRecords",
    "TablePlanRecord",
    "TableRecord",
    "TrainerRecord",
    "VersionRecords",
]

#: One stored ring slot: `[slot, step, array, row, checksum]` (slot index in the ring,
#: the step t whose w_t it holds, the (rows, width) array and its row holding it, and
#: the row's `crc32c:`), or in stores written before rows `[slot, step, array]` (the
#: array is the slot, width-long). `cocoon_ckpt.format.ring_rows` reads both.
RingSlot: TypeAlias = list[Any]

#: `model_shapes`: each model state_dict entry's shape.
ModelShapes: TypeAlias = dict[str, list[int]]


class TrainerRecord(TypedDict):
    """`trainer`: where the trainer stands."""

    step: int
    """Steps taken (the next step index t)."""


class OptimizerValue(TypedDict, total=False):
    """One entry of an optimizer parameter's state: a tensor stored as an array, or a
    JSON value kept in the record."""

    array: str
    """Version array name holding the tensor (`optim/<idx>/<key>`)."""
    value: Any
    """The value itself (a step count, a flag)."""


class OptimizerRecord(TypedDict):
    """`optimizer`: torch's optimizer state_dict with its tensors moved to arrays."""

    param_groups: list[dict[str, Any]]
    """torch's param_groups, as they are."""
    state: dict[str, dict[str, OptimizerValue]]
    """Per parameter index (as a string), per state key."""


class SamplerRecord(TypedDict):
    """`sampler`: `CyclicPoissonSampler.state_dict()`."""

    kind: Literal["CyclicPoissonSampler"]
    schema_version: int
    dataset_size: int
    batch_size: int
    bands: int
    seed: int


class AccountantRecord(TypedDict):
    """`accountant`: `Accountant.state_dict()`; `epsilon` is filled in by the writer."""

    kind: Literal["Accountant"]
    schema_version: int
    method: str
    noise_multiplier: float
    dataset_size: int
    batch_size: int
    bands: int
    delta: float
    steps: int
    event: dict[str, Any] | None
    """The composed dp-accounting event (None before the first step; a BLT run's is one
    `GaussianDpEvent` at sigma / sensitivity)."""
    epsilon: float | None
    sensitivity: NotRequired[float]
    """A BLT run's min-sep sensitivity (`dp.blt.accounting`); absent for BandMF."""


class MechanismRecord(TypedDict):
    """`mechanism`: `BandMF.state_dict()` (the band coefficients, bit for bit), or a
    BLT's (`BLTRecord`)."""

    kind: Literal["BandMF"]
    schema_version: int
    mechanism: str
    steps: int
    coefficients: list[float]


class BLTRecord(TypedDict):
    """`mechanism` of a BLT run: `BLT.state_dict()`, the parameters a resume rebuilds
    the strategy from (never fitted again), bit for bit. Its noise shards' slots are
    the d buffers after step t - 1, all rewritten each version."""

    kind: Literal["BLT"]
    schema_version: int
    steps: int
    buf_decay: list[float]
    """theta, (d,) decreasing."""
    output_scale: list[float]
    """omega, (d,)."""


class GeneratorRecord(TypedDict):
    """`generator`: the noise generator backend (`dp.noise.generator_backend()`)."""

    scheme: str
    torch: str
    gemv: str


class PlacementRecord(TypedDict):
    """Which columns of the noise vector lay on which tier when the version was taken."""

    tier: str
    start: int
    stop: int
    device: NotRequired[str]
    """The device of a device tier."""
    rank: NotRequired[int]
    """The rank holding the columns (multi-process jobs)."""


class ShardRecord(TypedDict):
    """One rank's ring shard: columns [start, stop) of every stored slot."""

    start: int
    stop: int
    slots: list[RingSlot]


class RankShard(ShardRecord):
    """What a rank reports to the coordinator: its shard and its placement."""

    placement: list[PlacementRecord]


class NoiseRecord(TypedDict):
    """`noise`: the dense correlated noise's state (the ring itself is in arrays)."""

    t: int
    """Steps of noise generated."""
    dim: int
    """Length of the noise vector (the dense parameters, flattened in `param_names`
    order)."""
    dtype: str
    """`float32` or `float64`."""
    head: int
    """The ring slot step t writes next (t mod (b-1); 0 when b = 1)."""
    shards: list[ShardRecord]
    """The ring, as stored per rank shard (any world size may read it)."""
    placement: NotRequired[list[PlacementRecord]]
    plan: NotRequired[dict[str, Any] | None]
    """The tier plan the history was split by (None: one host tier)."""
    history_bytes: NotRequired[int]


class NumpyRngRecord(TypedDict):
    """numpy's global generator state, less its key array (array `rng/numpy`)."""

    kind: str
    pos: int
    has_gauss: int
    cached_gaussian: float


#: Python's `random.getstate()`: `[version, internal state, gauss_next]`.
PythonRngRecord: TypeAlias = list[Any]


class PackedArrayRecord(TypedDict):
    """A small array held in a record (`format.packed`): no file of its own."""

    dtype: str
    """`uint8`, `uint32`, `uint64` or `int64`."""
    shape: list[int]
    data: str
    """base64 of the array's little-endian C-order bytes."""


class RngRecord(TypedDict):
    """`rng`: the global generators' states (torch's is array `rng/torch`, or packed)."""

    numpy: NumpyRngRecord
    python: PythonRngRecord
    cuda: NotRequired[int]
    """How many CUDA generators' states are stored (arrays `rng/cuda/<i>`), when the
    job had initialised CUDA; absent: none."""
    packed: NotRequired[dict[str, PackedArrayRecord]]
    """The states of arrays `rng/<kind>` (`torch`, `numpy`, `cuda/<i>`) held here
    instead, by kind (the packed layout); absent: they are arrays."""


class TablePlanRecord(TypedDict):
    """An embedding table's plan (`TablePlan.to_record()`)."""

    mode: str
    hot: int
    threshold: Any
    profile: dict[str, Any]


class CscPartRecord(TypedDict):
    """One rank's part of a table's CSC: the cold slots [start, stop)
    (`embedding.csc_shards`, arrays `emb/<param>/csc/slots-<start>-<stop>/...`)."""

    start: int
    stop: int
    entries: int


class CscRecord(TypedDict):
    """Size of a table's precomputed coalesced noise (arrays under shared/)."""

    entries: int
    bytes: int
    steps: int
    parts: NotRequired[list[CscPartRecord]]
    """Present when several ranks hold it in parts (absent: one whole CSC)."""


class TableRecord(TypedDict):
    """One embedding table's noise state."""

    param: str
    rows: int
    dim: int
    plan: TablePlanRecord
    t: int
    """Steps of online noise generated (the trainer's step without an online ring)."""
    online_rows: int
    slots: list[RingSlot]
    """The online ring's slots (whole width)."""
    csc: CscRecord | None
    precompute_seconds: NotRequired[float]
    history_bytes: int


class EmbeddingRecord(TypedDict):
    """`embedding`: the embedding tables' noise state (present only in embedding jobs)."""

    threat_model: str
    cursor: int
    tables: list[TableRecord]


#: The optimizer a job built: its qualified class name and every param_group
#: hyperparameter as built (`params`: how many parameters the group holds).
OptimizerIdentity = TypedDict(
    "OptimizerIdentity", {"class": str, "param_groups": list[dict[str, Any]]}
)

#: The LR scheduler a job built: its qualified class name and initial `state_dict()`.
SchedulerIdentity = TypedDict("SchedulerIdentity", {"class": str, "state": Any})


class DatasetIdentity(TypedDict):
    """The training set: `len(dataset)` and a digest of a seeded sample of examples."""

    size: int
    digest: str
    """sha256 over 16 examples a seeded draw picks (dtypes, shapes and bytes)."""


class DeviceIdentity(TypedDict):
    """`identity.device`: the device type the model ran on, when it is not the CPU."""

    type: str
    """`torch.device(...).type`, e.g. `cuda`."""


class IdentityRecord(TypedDict):
    """`identity`: what a job's real objects are, taken when it was built
    (`train.identity`); a resume refuses any difference."""

    optimizer: OptimizerIdentity
    scheduler: SchedulerIdentity | None
    """None: the job has no scheduler."""
    dataset: DatasetIdentity
    device: NotRequired[DeviceIdentity]
    """Absent: the CPU (stores written before it, and every CPU job)."""


class PartStateRecord(TypedDict):
    """A part's state dict with its tensors moved to arrays (`format.part_state` grammar)."""

    kind: str
    """The part's qualified class name (a resume refuses another)."""
    state: Any
    """The tagged state (tensors as `{"tensor": array name}`)."""


class SnapshotRecords(TypedDict):
    """The records a snapshot of the trainer's state writes (the codec's output)."""

    trainer: TrainerRecord
    optimizer: OptimizerRecord
    sampler: SamplerRecord
    accountant: AccountantRecord
    mechanism: MechanismRecord | BLTRecord
    noise: NoiseRecord
    generator: GeneratorRecord
    rng: RngRecord
    param_names: list[str]
    """The dense parameters in noise-vector order."""
    embedding: NotRequired[EmbeddingRecord]
    identity: NotRequired[IdentityRecord]
    """Absent from stores written before real-object fingerprints."""
    scheduler: NotRequired[PartStateRecord | None]
    """The LR scheduler's state (None: the job has none)."""
    stateful: NotRequired[dict[str, PartStateRecord]]
    """The job's other state (`JobParts.stateful`), by name."""


class MetricSeries(TypedDict):
    """One metric's points: the steps as runs, then one value per step in run order."""

    steps: list[list[int]]
    """Runs `[start, stop)` of consecutive step indices t (0-based), increasing and
    disjoint: `[[0, 300]]` is a point at every step of 0..299."""
    values: str | list[float]
    """The value at each of those steps, finite: base64 of their little-endian float64
    bytes (schema 2), or a JSON list of numbers (schema 1, still read)."""


class MetricsRecord(TypedDict):
    """`metrics`: every point logged for the steps before the version's (the whole
    curve so far, so retention never cuts its start; `format.metrics`)."""

    schema_version: int
    stop: int
    """The version's step: every point is of a step before it."""
    series: dict[str, MetricSeries]
    """By metric name (`loss`: the sampled batch's mean loss, recorded at every step
    whose loss is finite; other names are what the loop logged)."""


class JobRecords(TypedDict):
    """The records the job runner adds to every version."""

    config: dict[str, Any]
    """`JobConfig.to_record()`."""
    fingerprint: str
    model_shapes: ModelShapes
    key_id: str
    """Public id of the noise key (`keys.key_id`)."""
    key_location: str
    threat_model: str
    complete: bool
    """The job's last step is in this version (a hint only: export re-derives it)."""
    metrics: NotRequired[MetricsRecord]
    """Absent from stores written before metrics were stored."""
    grad_threads: NotRequired[int]
    """torch intra-op threads the job's gradients run at (`train.grad_threads`; not in
    the fingerprint). Absent from stores written before it: a resume keeps its count."""


class VersionRecords(SnapshotRecords, JobRecords):
    """Every record a version of a job carries, by its name in the manifest."""
