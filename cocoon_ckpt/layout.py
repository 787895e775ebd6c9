"""Names cocoon_ckpt gives things in a store: array names, kinds, the key, threat models.

Import-light on purpose (no torch): the store-only commands use it.
"""

from __future__ import annotations

__all__ = [
    "KEY_SECRET",
    "THREAT_MODELS",
    "THREAT_MODEL_DEFAULT",
    "MODEL_PREFIX",
    "SCHEDULER_PREFIX",
    "array_kind",
    "csc_array",
    "emb_name",
    "model_name",
    "optim_name",
    "ring_name",
    "ring_rows_name",
    "rng_name",
    "stateful_prefix",
    "table_ring_rows_name",
]

#: The noise key's secret name in the store (`secret/noise.key`), unless a key file is used.
KEY_SECRET = "noise.key"

THREAT_MODEL_DEFAULT = "intermediate_iterates"
"""Every version carries full noise state: secure against an adversary who sees every
intermediate model (the standard BandMF guarantee)."""

#: What each threat model promises; audit, inspect and export print it.
THREAT_MODELS = {
    "intermediate_iterates": "every version carries the full noise state: private against "
    "an adversary who sees every intermediate model (the standard BandMF guarantee)",
    "final_model": "coalesced embedding noise: only the exported final model is private; "
    "an intermediate checkpoint does not carry the full noise of cold rows and must not "
    "be released",
}


#: The folder of the model's parameters and buffers in a version: `model/<state_dict key>`.
MODEL_PREFIX = "model/"


def model_name(key: str) -> str:
    """The array of the model's state_dict entry `key`."""
    return MODEL_PREFIX + key


def optim_name(param: int, key: str) -> str:
    """The array of optimizer state `key` (e.g. `exp_avg`) of parameter index `param`."""
    return f"optim/{param}/{key}"


def rng_name(kind: str) -> str:
    """The array of a random generator's state: `torch`, `numpy`, `cuda/<i>`."""
    return f"rng/{kind}"


def array_kind(name: str) -> str:
    """The kind of a version's array, from its name: model, optimizer, ring, rng, csc,
    emb_ring (a table's online history), emb_order."""
    top = name.split("/", 1)[0]
    if top == "emb":
        part = name.split("/")[2] if name.count("/") >= 2 else ""
        return {"csc": "csc", "ring": "emb_ring"}.get(part, "emb_order")
    return "optimizer" if top == "optim" else top


#: The folder of the learning-rate scheduler's arrays: `scheduler/<i>` (`format.part_state`).
SCHEDULER_PREFIX = "scheduler"


def stateful_prefix(name: str) -> str:
    """The folder of the arrays of the job's stateful part `name`: `stateful/<name>/<i>`."""
    return f"stateful/{name}"


def ring_name(shard: int, step: int) -> str:
    """The 1-D array holding w of `step` for ring shard `shard`, in stores written
    before slots were stored as rows (read, never written)."""
    return f"ring/shard-{shard:04d}/w-{step:08d}"


def ring_rows_name(shard: int, first: int, last: int) -> str:
    """The (k, width) array of ring shard `shard`'s slots new in a version: w of steps
    `first`..`last`, one row each (`cocoon_ckpt.format.ring_rows`)."""
    return f"ring/shard-{shard:04d}/w-{first:08d}-{last:08d}"


def table_ring_rows_name(param: str, first: int, last: int) -> str:
    """The (k, online width) array of table `param`'s online ring slots new in a
    version, steps `first`..`last`."""
    return emb_name(param, f"ring/w-{first:08d}-{last:08d}")


def emb_name(param: str, part: str) -> str:
    """An embedding table's array: `emb/<param>/ring/w-<step>`, `.../csc/values`, ..."""
    return f"emb/{param}/{part}"


def csc_part_name(param: str, start: int, stop: int, array: str) -> str:
    """Array `array` (`col_ptr`, `rows`, `values`) of the part of table `param`'s CSC
    that holds the cold slots [start, stop) (several ranks', `embedding.csc_shards`)."""
    return emb_name(param, f"csc/slots-{start}-{stop}/{array}")


def csc_array(name: str) -> tuple[str, tuple[int, int] | None, str] | None:
    """The inverse of `emb_name(param, "csc/<array>")` and `csc_part_name`: (param,
    (start, stop) of a rank's part or None for a one-process CSC, array), or None for
    any other array name. The one parser of CSC array names (the tools' and a resume's
    choice of which arrays to stream both take it)."""
    head, sep, tail = name.rpartition("/csc/")
    if not sep or not head.startswith("emb/") or len(head) == len("emb/"):
        return None
    slots: tuple[int, int] | None = None
    part, _, array = tail.rpartition("/")
    if part:
        start, dash, stop = part.removeprefix("slots-").partition("-")
        if not part.startswith("slots-") or not dash or not (start.isdigit() and stop.isdigit()):
            return None
        slots = (int(start), int(stop))
    if array not in ("col_ptr", "rows", "values"):
        return None
    return head[len("emb/") :], slots, array
