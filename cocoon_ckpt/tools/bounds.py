"""What a version's config allows it to hold, checked before anything is read.

A reader that regenerates noise or reads arrays does work and allocates memory in
proportion to numbers it reads: step labels, shapes, slot and entry counts. Each is
checked here against the version's config and model shapes first, so a forged label
or shape is a finding in microseconds instead of minutes of work or a 1 TB allocation
(I7). Import-light (no torch).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from cocoon_ckpt.format.packed import MAX_CUDA_STATES, packed_nbytes
from cocoon_ckpt.format.parts import user
from cocoon_ckpt.format.ring_rows import slot_refs
from cocoon_ckpt.layout import (
    MODEL_PREFIX,
    SCHEDULER_PREFIX,
    array_kind,
    csc_part_name,
    emb_name,
    stateful_prefix,
)
from cocoon_ckpt.train.config import JobConfig
from state import Manifest

__all__ = ["VersionBounds", "check_bounds"]

#: Largest RNG state arrays a version holds (torch CPU: 5056 bytes; numpy MT19937: 624).
_RNG_MAX = 1 << 16
_NOISE_DTYPES = ("float32", "float64")
#: Most BLT buffers a version may hold (the optimiser stops at 8; jax_privacy's fits
#: use fewer than 16).
_MAX_BUFFERS = 64


@dataclass(slots=True)
class VersionBounds:
    """What `check_bounds` found for one version."""

    problems: list[str] = field(default_factory=list)
    """One line per number outside what the config allows."""
    unsafe: set[str] = field(default_factory=set)
    """Array names whose recorded shape or role is out of bounds: never read them."""
    noise_ok: bool = True
    """The dense noise records (mechanism, dim, shards, slot labels) may drive
    regeneration."""
    embedding_ok: bool = True
    """The embedding records may drive regeneration and recomputation."""
    steps: int = 0
    """n from the config (0 when the config is unreadable)."""

    @property
    def ok(self) -> bool:
        return not self.problems


def _numel(shape: Any) -> int:
    if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
        raise ValueError(f"shape {shape!r} is not a list of sizes")
    return math.prod(shape)


def _int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what} {value!r} is not an integer")
    return value


class _Checker:
    def __init__(self, m: Manifest, out: VersionBounds, bands: int) -> None:
        self.m = m
        self.out = out
        self.bands = bands
        self.claimed: set[str] = set()

    def problem(self, msg: str, *names: str) -> None:
        self.out.problems.append(msg)
        self.out.unsafe.update(names)

    def array(self, name: str, shape: tuple[int, ...], dtype: str | None = None) -> bool:
        """The array `name` exists with this shape (and dtype); marks it claimed."""
        meta = self.m.arrays.get(name)
        if meta is None:
            self.problem(f"records name array {name}, which the manifest does not list")
            return False
        self.claimed.add(name)
        if meta.shape != shape or (dtype is not None and meta.dtype != dtype):
            self.problem(
                f"array {name} is recorded as {meta.dtype}{list(meta.shape)}, the config "
                f"allows {dtype or meta.dtype}{list(shape)}",
                name,
            )
            return False
        return True

    def window(self, step: Any, what: str) -> int:
        """A ring slot label: w of a step in [step - (b-1), step), the version's window."""
        s = _int(step, f"{what} step label")
        lo = max(0, self.m.step - (self.bands - 1))
        if not lo <= s < self.m.step:
            raise ValueError(
                f"{what} is labelled step {s}, outside [{lo}, {self.m.step}): a version at "
                f"step {self.m.step} with b={self.bands} holds only the last b-1 steps"
            )
        return s


def _blt_slots(c: _Checker, slots: Any, buffers: int) -> list[tuple[int, str, int | None]]:
    """A BLT's ring: its d buffers, each the state after step (version step - 1), so
    every label is that one step (none before step 0), each buffer at most once."""
    if not isinstance(slots, list) or len(slots) > buffers:
        raise ValueError(
            f"BLT buffers list {len(slots) if isinstance(slots, list) else slots!r} "
            f"slots, more than d = {buffers}"
        )
    out: list[tuple[int, str, int | None]] = []
    seen: set[int] = set()
    for ref in slot_refs(slots, "BLT buffers"):
        if not 0 <= ref.slot < buffers or ref.slot in seen:
            raise ValueError(f"BLT buffer index {ref.slot} is repeated or outside [0, {buffers})")
        seen.add(ref.slot)
        s = _int(ref.step, f"BLT buffer {ref.array} step label")
        if s != c.m.step - 1:
            raise ValueError(
                f"BLT buffer {ref.array} is labelled step {s}; a version at step "
                f"{c.m.step} holds the buffers after step {c.m.step - 1}"
            )
        out.append((s, ref.array, ref.row))
    return out


def _slots(c: _Checker, slots: Any, what: str) -> list[tuple[int, str, int | None]]:
    if not isinstance(slots, list) or len(slots) > c.bands - 1:
        raise ValueError(
            f"{what} lists {len(slots) if isinstance(slots, list) else slots!r} "
            f"slots, more than b-1 = {c.bands - 1}"
        )
    out: list[tuple[int, str, int | None]] = []
    seen: set[int] = set()
    for ref in slot_refs(slots, what):
        if not 0 <= ref.slot < c.bands - 1:
            raise ValueError(f"{what} slot index {ref.slot} is outside [0, {c.bands - 1})")
        s = c.window(ref.step, f"{what} slot {ref.array}")
        if s in seen:
            raise ValueError(f"{what} holds step {s} twice")
        seen.add(s)
        out.append((s, ref.array, ref.row))
    return out


def _slot_shape(
    c: _Checker, name: str, row: int | None, width: int, most: int | None = None
) -> tuple[int, ...]:
    """The shape a slot's array may have: (width,), or (rows, width) for an array of
    rows, rows in (row, most] (most: b-1 by default; anything else is reported by
    `c.array`)."""
    if row is None:
        return (width,)
    most = c.bands - 1 if most is None else most
    meta = c.m.arrays.get(name)
    rows = meta.shape[0] if meta is not None and len(meta.shape) == 2 else -1
    return (rows if row < rows <= most else row + 1, width)


def _blt_buffers(c: _Checker, mech: dict[str, Any]) -> int:
    """d, from a BLT mechanism record checked against the config."""
    decay, scale = mech["buf_decay"], mech["output_scale"]
    if not isinstance(decay, list) or not isinstance(scale, list) or len(decay) != len(scale):
        raise ValueError("BLT record's buf_decay and output_scale are not lists of one length")
    if len(decay) > _MAX_BUFFERS:
        raise ValueError(f"BLT record holds {len(decay)} buffers, more than {_MAX_BUFFERS}")
    if mech["steps"] != c.out.steps:
        raise ValueError(
            f"BLT record is for steps={mech['steps']!r}, the config's n = {c.out.steps}"
        )
    return len(decay)


def _noise(c: _Checker, rec: dict[str, Any], shapes: dict[str, list[int]]) -> None:
    mech = rec["mechanism"]
    buffers = _blt_buffers(c, mech) if mech["kind"] == "BLT" else None
    coeffs = mech.get("coefficients")
    if buffers is None and (not isinstance(coeffs, list) or len(coeffs) != c.bands):
        raise ValueError(
            f"mechanism record holds {len(coeffs) if isinstance(coeffs, list) else coeffs!r} "
            f"coefficients, the config's b = {c.bands}"
        )
    noise = rec["noise"]
    dim = _int(noise["dim"], "noise dim")
    names = rec.get("param_names")
    if isinstance(names, list):
        want = sum(_numel(shapes[p]) for p in names)
        if dim != want:
            raise ValueError(f"noise dim {dim} is not {want}, the size of the noised parameters")
    elif not 0 <= dim <= sum(_numel(s) for s in shapes.values()):
        raise ValueError(f"noise dim {dim} exceeds the model's size")
    dtype = noise["dtype"]
    if dtype not in _NOISE_DTYPES:
        raise ValueError(f"noise dtype {dtype!r} is not one of {_NOISE_DTYPES}")
    for shard in noise["shards"]:
        start, stop = _int(shard["start"], "shard start"), _int(shard["stop"], "shard stop")
        if not 0 <= start < stop <= dim:
            raise ValueError(f"noise shard [{start}, {stop}) is not inside [0, {dim})")
        if buffers is not None:
            refs = _blt_slots(c, shard["slots"], buffers)
        else:
            refs = _slots(c, shard["slots"], "ring")
        for _s, name, row in refs:
            shape = _slot_shape(c, name, row, stop - start, buffers)
            if not c.array(name, shape, dtype):
                c.out.noise_ok = False


def _embedding(c: _Checker, emb: dict[str, Any], shapes: dict[str, list[int]], n: int) -> None:
    for t in emb["tables"]:
        param = t["param"]
        shape = shapes.get(param)
        rows, dim = _int(t["rows"], "table rows"), _int(t["dim"], "table dim")
        if shape != [rows, dim]:
            raise ValueError(f"table {param} is recorded as {rows} x {dim}, the model as {shape}")
        online = _int(t["online_rows"], "table online_rows")
        if not 0 <= online <= rows:
            raise ValueError(f"table {param}: online_rows {online} is outside [0, {rows}]")
        hot = _int(t["plan"].get("hot", 0), "table hot rows")
        if not 0 <= hot <= rows:
            raise ValueError(f"table {param}: hot rows {hot} outside [0, {rows}]")
        ok = True
        for _s, name, row in _slots(c, t["slots"], f"table {param}"):
            ok &= c.array(name, _slot_shape(c, name, row, online * dim))
        order = emb_name(param, "order")
        if order in c.m.arrays:
            ok &= c.array(order, (rows,), "int64")
        csc = t.get("csc")
        # one process's whole CSC, or several ranks' parts (each a CSC of its slots)
        sets = [{k: emb_name(param, f"csc/{k}") for k in ("col_ptr", "rows", "values")}]
        if csc is not None and "parts" in csc:
            sets = [
                {
                    k: csc_part_name(param, _int(p["start"], "part"), _int(p["stop"], "part"), k)
                    for k in ("col_ptr", "rows", "values")
                }
                for p in csc["parts"]
            ]
        for arrays in sets if csc is not None else []:
            if arrays["rows"] not in c.m.arrays:
                c.problem(f"table {param}: CSC array {arrays['rows']} is not in the version")
                ok = False
                continue
            entries = c.m.arrays[arrays["rows"]].shape
            e = entries[0] if len(entries) == 1 else -1
            if not 0 <= e <= rows * (n + 1):
                c.problem(
                    f"table {param}: the CSC lists {entries} entries, more than rows x (n+1) "
                    f"= {rows * (n + 1)}",
                    arrays["rows"],
                    arrays["values"],
                )
                ok = False
            else:
                ok &= c.array(arrays["col_ptr"], (n + 2,), "int64")
                ok &= c.array(arrays["rows"], (e,), "int64")
                ok &= c.array(arrays["values"], (e, dim))
        if not ok:
            c.out.embedding_ok = False


def _user_parts(c: _Checker, rec: dict[str, Any]) -> None:
    """The arrays the scheduler's and stateful parts' records name, each inside its
    part's folder (the job's own state: no config bounds its size)."""
    parts = [] if rec.get("scheduler") is None else [(rec["scheduler"], SCHEDULER_PREFIX)]
    parts += [(r, stateful_prefix(name)) for name, r in (rec.get("stateful") or {}).items()]
    for part, prefix in parts:
        for name in user.array_names(part, prefix):
            if name in c.m.arrays:
                c.claimed.add(name)
            else:
                c.problem(f"array {name} of the {prefix} record is not in the version")


def _plain_arrays(c: _Checker, shapes: dict[str, list[int]]) -> None:
    biggest = max((_numel(s) for s in shapes.values()), default=0)
    for name, meta in c.m.arrays.items():
        kind = array_kind(name)
        if name in c.claimed or kind in ("ring", "csc", "emb_ring", "emb_order"):
            continue
        if kind == "model":
            want = shapes.get(name[len(MODEL_PREFIX) :])
            if want is None:
                c.problem(f"array {name} is not a parameter of the recorded model", name)
            elif list(meta.shape) != want:
                c.problem(
                    f"array {name} is recorded as {list(meta.shape)}, the model shape is {want}",
                    name,
                )
        elif kind == "optimizer":
            # optimizer state: a scalar (step) or a tensor the size of some parameter
            if math.prod(meta.shape) > biggest:
                c.problem(
                    f"array {name} holds {math.prod(meta.shape)} values, more than the "
                    f"largest parameter ({biggest})",
                    name,
                )
        elif kind == "rng":
            if math.prod(meta.shape) > _RNG_MAX:
                c.problem(
                    f"array {name} holds {math.prod(meta.shape)} values, not an RNG state", name
                )
        else:
            c.problem(
                f"array {name} is not referenced by the version's records, nor of a kind "
                "the job writes",
                name,
            )


def check_bounds(m: Manifest) -> VersionBounds:
    """Every step label, shape and count of version `m` against its config.

    Never raises on malformed records: each is a problem in the result.
    """
    out = VersionBounds()
    rec = m.records
    try:
        config = JobConfig.from_record(rec["config"])
        shapes = rec["model_shapes"]
        if not isinstance(shapes, dict):
            raise ValueError("model_shapes is not a mapping")
        for s in shapes.values():
            _numel(s)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        out.problems.append(f"the config or model shapes cannot be read ({exc})")
        out.unsafe.update(m.arrays)
        out.noise_ok = out.embedding_ok = False
        return out
    n = config.dp.steps
    out.steps = n
    c = _Checker(m, out, config.dp.bands)
    if not 0 <= m.step <= n:
        out.problems.append(f"the version is at step {m.step}, outside the config's [0, {n}]")
        out.unsafe.update(m.arrays)
        out.noise_ok = out.embedding_ok = False
        return out
    try:
        _noise(c, rec, shapes)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        out.problems.append(f"noise records out of bounds ({exc})")
        out.noise_ok = False
    if rec.get("embedding") is not None:
        try:
            _embedding(c, rec["embedding"], shapes, n)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            out.problems.append(f"embedding records out of bounds ({exc})")
            out.embedding_ok = False
    try:
        _user_parts(c, rec)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        out.problems.append(f"scheduler or stateful records out of bounds ({exc})")
    # noise arrays the records failed to vouch for are never read
    for name in m.arrays:
        if name not in c.claimed and name.split("/", 1)[0] in ("ring", "emb"):
            out.unsafe.add(name)
            if out.noise_ok and out.embedding_ok:
                out.problems.append(f"array {name} is not referenced by the version's records")
    _packed_rng(out, rec)
    _plain_arrays(c, shapes)
    return out


def _packed_rng(out: VersionBounds, rec: dict[str, Any]) -> None:
    """The generators' states packed into the `rng` record: the generators the record
    names, each of a state's form and size (`format.packed` holds each to 64 KiB, under
    `_RNG_MAX` values, as the arrays `rng/<kind>` are held)."""
    rng = rec.get("rng")
    if not isinstance(rng, dict) or rng.get("packed") is None:
        return
    packed = rng["packed"]
    if not isinstance(packed, dict):
        out.problems.append("the rng record's packed states are not a mapping")
        return
    cuda = rng.get("cuda", 0)
    cuda = cuda if type(cuda) is int and 0 <= cuda <= MAX_CUDA_STATES else 0
    want = {"torch", "numpy", *(f"cuda/{i}" for i in range(cuda))}
    if set(packed) != want:
        out.problems.append(
            f"the rng record packs the states of {sorted(packed)}, not of {sorted(want)}"
        )
    for kind, p in packed.items():
        try:
            packed_nbytes(p)
        except ValueError as exc:
            out.problems.append(f"the rng record's packed {kind} state: {exc}")
