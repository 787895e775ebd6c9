"""The audit of the dense noise history: the key id of every version against the
audited key, and every stored ring slot (or BLT buffer) compared, at random
coordinates, with noise regenerated from the key (so a slot rewritten with a valid
checksum is still caught)."""

from __future__ import annotations

from typing import Any

import numpy as np

from cocoon_ckpt.dp.blt.strategy import BLT
from cocoon_ckpt.dp.mechanism import BandMF
from cocoon_ckpt.format.ring_rows import slot_refs, slot_values
from cocoon_ckpt.keys import key_id
from cocoon_ckpt.records import NoiseRecord
from cocoon_ckpt.tools.audit.report import AuditReport
from cocoon_ckpt.tools.bounds import VersionBounds
from cocoon_ckpt.tools.regenerate import regenerate_rows
from state import CorruptVersionError, Manifest, Store, Version

__all__ = ["check_noise"]

#: One stored slot's sample: (version, step label, which audited coordinates fall in
#: its shard, the slot's values at them, its slot index).
_Sample = tuple[int, int, np.ndarray, np.ndarray, int]


def check_noise(
    store: Store,
    manifests: dict[int, Manifest],
    bounds: dict[int, VersionBounds],
    key: bytes,
    coordinates: int,
    seed: int,
    report: AuditReport,
) -> None:
    """Regenerate the noise at random coordinates and compare every stored ring slot.

    Args:
        store: the audited store.
        manifests: the parsed manifests, by version number.
        bounds: each version's bounds; only versions whose noise records are in bounds
            drive regeneration, and `unsafe` arrays are never read.
        key: the job's 32-byte noise key.
        coordinates: how many coordinates to regenerate (all when >= the model size).
        seed: seed of the coordinate choice.
        report: where findings and the `noise` counts go.

    Raises:
        KeyError, TypeError, ValueError, IndexError: records of the wrong type or shape
            (the caller turns these into a finding).
    """
    usable = [v for v in manifests if bounds[v].noise_ok]
    if not usable:
        report.skipped.append(
            "noise: no version's noise records are within the config's bounds (see the "
            "bounds findings); nothing was regenerated"
        )
        return
    newest = manifests[max(usable)]
    rec = newest.records
    key_ids = {m.records.get("key_id") for m in manifests.values()}
    kid = key_id(key)
    for v, m in sorted(manifests.items()):
        if m.records.get("key_id") != kid:
            report.add(
                "key",
                f"key id {m.records.get('key_id')} differs from the audited key's {kid}: "
                "this version's noise came from another key (another job's manifest?)",
                v,
            )
    noise: NoiseRecord = rec["noise"]
    dim = int(noise["dim"])
    dp = rec["config"]["dp"]
    rng = np.random.default_rng(seed)
    k = min(coordinates, dim)
    coords = np.sort(rng.choice(dim, size=k, replace=False)).astype(np.int64)
    stored = _stored_samples(store, manifests, bounds, dim, coords)
    if rec["mechanism"].get("kind") == "BLT":
        blt = BLT.from_state_dict(rec["mechanism"])
        _check_blt(key, blt, dim, dp, str(noise["dtype"]), coords, stored, report)
        report.checks["noise"].update({"coordinates": k, "seed": seed, "key_ids": len(key_ids)})
        return
    mechanism = BandMF.from_state_dict(rec["mechanism"])
    steps = 1 + max((s for _, s, _, _, _ in stored.values()), default=-1)
    if steps == 0 or mechanism.bands == 1:
        report.checks["noise"] = {
            "coordinates": k,
            "seed": seed,
            "slots": 0,
            "note": "b = 1: no history is stored" if mechanism.bands == 1 else "no slots",
        }
        return
    # the ring as it stood after each stored step: a column-normalized C's tail scales
    # what the step returns, not what the ring keeps
    want = regenerate_rows(
        key,
        mechanism,
        dim,
        float(dp["noise_multiplier"]) * float(dp["max_grad_norm"]),
        str(noise["dtype"]),
        coords,
        {(s % (mechanism.bands - 1), s) for _, s, _, _, _ in stored.values()},
        # the job's generator (older configs have no field: they ran the default)
        rng=str(dp.get("noise_rng", "default")),
    )
    std = float(dp["noise_multiplier"]) * float(dp["max_grad_norm"])
    tol = _tolerance(noise["dtype"], std)
    worst = 0.0
    identical = 0
    for path, (v, step, inside, got, _slot) in sorted(stored.items()):
        dev, same = _deviation(got, want[(step % (mechanism.bands - 1), step)][inside])
        worst = max(worst, dev)
        identical += same
        if dev > tol:
            report.add(
                "noise",
                f"ring slot {path} (w of step {step}) differs from the noise regenerated "
                f"from the key by up to {dev:.3g} (tolerance {tol:.3g}) at the audited "
                "coordinates: the stored history was altered or came from another mechanism",
                v,
            )
    report.checks["noise"] = {
        "coordinates": k,
        "seed": seed,
        "steps_regenerated": steps,
        "slots": len(stored),
        "bit_identical": identical,
        "max_deviation": worst,
        "key_ids": len(key_ids),
    }


def _stored_samples(
    store: Store,
    manifests: dict[int, Manifest],
    bounds: dict[int, VersionBounds],
    dim: int,
    coords: np.ndarray,
) -> dict[str, _Sample]:
    """Every stored slot, once per array path, from every readable version whose noise
    has `dim` coordinates, sampled at `coords`."""
    stored: dict[str, _Sample] = {}
    for v, m in sorted(manifests.items()):
        if not bounds[v].noise_ok:
            continue  # its noise records may not even exist: reported by the bounds check
        noise: NoiseRecord = m.records["noise"]
        if noise["dim"] != dim:
            continue
        ver = Version(store, m)
        for shard in noise["shards"]:
            for ref in slot_refs(shard["slots"]):
                meta = m.arrays.get(ref.array)
                if meta is None or ref.array in bounds[v].unsafe:
                    continue
                # a slot is a row of an array (or, in older stores, the whole array)
                where = meta.path if ref.row is None else f"{meta.path} row {ref.row}"
                if where in stored:
                    continue
                try:
                    arr = slot_values(ver, ref)
                except CorruptVersionError:
                    continue  # reported by the checksum check
                lo = int(shard["start"])
                inside = (coords >= lo) & (coords < int(shard["stop"]))
                stored[where] = (v, ref.step, inside, arr[coords[inside] - lo], ref.slot)
    return stored


def _check_blt(
    key: bytes,
    blt: BLT,
    dim: int,
    dp: dict[str, Any],
    dtype: str,
    coords: np.ndarray,
    stored: dict[str, _Sample],
    report: AuditReport,
) -> None:
    """Every stored BLT buffer (the state after its step label) against the buffers
    regenerated by replaying `blt_step` from step 0 at the audited coordinates."""
    std = float(dp["noise_multiplier"]) * float(dp["max_grad_norm"])
    want = regenerate_rows(
        key,
        blt,
        dim,
        std,
        dtype,
        coords,
        {(slot, step) for _, step, _, _, slot in stored.values()},
        rng=str(dp.get("noise_rng", "default")),
    )
    tol = _tolerance(dtype, std)
    worst, identical = 0.0, 0
    for path, (v, step, inside, got, slot) in sorted(stored.items()):
        dev, same = _deviation(got, want[(slot, step)][inside])
        worst = max(worst, dev)
        identical += same
        if dev > tol:
            report.add(
                "noise",
                f"BLT buffer {path} (buffer {slot} after step {step}) differs from the one "
                f"regenerated from the key by up to {dev:.3g} (tolerance {tol:.3g}) at the "
                "audited coordinates: the stored state was altered or came from another BLT",
                v,
            )
    report.checks["noise"] = {
        "mechanism": "blt",
        "buffers": blt.buffers,
        "steps_regenerated": 1 + max((s for _, s in want), default=-1),
        "slots": len(stored),
        "bit_identical": identical,
        "max_deviation": worst,
    }


def _tolerance(dtype: str, std: float) -> float:
    """How far a stored value may sit from its regeneration: float32 sums of the b-1
    terms may round in another order than the engine's; float64 agrees to 1e-12."""
    return (1e-5 if dtype == "float32" else 1e-12) * std


def _deviation(got: np.ndarray, want: np.ndarray) -> tuple[float, int]:
    """The largest absolute difference of stored from regenerated values, and 1 when
    they are identical bit for bit (0 otherwise)."""
    dev = float(np.max(np.abs(got.astype(np.float64) - want.astype(np.float64)), initial=0.0))
    return dev, int(np.array_equal(got, want))
