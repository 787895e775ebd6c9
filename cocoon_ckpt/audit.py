"""The audit of a store's noise state: what `cocoon-ckpt audit` prints and exits on.

The audit trusts nothing it reads and executes nothing it reads (I7): every manifest of
the chain is parsed and every array checksummed, the stored ring slots are compared
with noise regenerated from the key (so a slot rewritten with a valid checksum is still
caught), epsilon is recomputed from the configuration (not from the accountant record),
"finished" is derived from the step count, and the fingerprint and key id of every
version are recomputed and compared. Every step label, shape and count is checked
against the config before any work or allocation depends on it (`cocoon_ckpt.bounds`).
Checks that need the job's data (an embedding table's access schedule) run only with a
job the caller names (`job=`, `--job`, `--example`); the report lists what was skipped.
"""

from __future__ import annotations

import math
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from state import CorruptVersionError, Manifest, Store, StoreError, Version

from . import config as cfgmod
from .accountant import epsilon as compute_epsilon
from .bounds import VersionBounds, check_bounds
from .catalog import own_prefix
from .errors import NoiseKeyError
from .exposure import walk_exposure
from .gemv import mix_history
from .guarantee import describe
from .job import key_id
from .jobs import JobParts, resolve
from .layout import KEY_SECRET, THREAT_MODEL_DEFAULT, THREAT_MODELS
from .mechanism import BandMF
from .noise import BLOCK, KeyedNoise

__all__ = [
    "AuditReport",
    "Finding",
    "audit_store",
]

# -- audit -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Finding:
    """One thing that does not hold."""

    check: str
    """Which check found it: chain, checksums, noise, accountant, fingerprint, key,
    permissions."""
    message: str
    """What is wrong, where, and what to do."""
    version: int | None = None

    def as_json(self) -> dict[str, Any]:
        return {"check": self.check, "version": self.version, "message": self.message}


@dataclass(slots=True)
class AuditReport:
    """What the audit checked and found. `ok` when nothing was found."""

    store: str
    findings: list[Finding] = field(default_factory=list)
    checks: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per check: what it covered (counts, seeds, deviations)."""
    info: dict[str, Any] = field(default_factory=dict)
    """Threat model, key presence, who can read the store, epsilon."""
    plots: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    """Checks not run, each with why and how to run it (e.g. no job was given)."""

    @property
    def ok(self) -> bool:
        return not self.findings

    def add(self, check: str, message: str, version: int | None = None) -> None:
        self.findings.append(Finding(check, message, version))

    def as_json(self) -> dict[str, Any]:
        return {
            "store": self.store,
            "ok": self.ok,
            "findings": [f.as_json() for f in self.findings],
            "checks": self.checks,
            "info": self.info,
            "skipped": self.skipped,
            "plots": self.plots,
        }

    def text(self) -> str:
        lines = [f"audit of {self.store}: " + ("all checks hold" if self.ok else "FINDINGS")]
        for name, c in self.checks.items():
            detail = ", ".join(f"{k}={v}" for k, v in c.items())
            lines.append(f"  {name:<12} {detail}")
        for k, v in self.info.items():
            if isinstance(v, dict):
                v = ", ".join(f"{a}={b}" for a, b in v.items() if not isinstance(b, dict))
            lines.append(f"  {k}: {v}")
        for sk in self.skipped:
            lines.append(f"SKIPPED: {sk}")
        for f in self.findings:
            where = f" (version {f.version})" if f.version is not None else ""
            lines.append(f"FINDING [{f.check}]{where}: {f.message}")
        for p in self.plots:
            lines.append(f"  plot: {p}")
        return "\n".join(lines)


def _load_audit_key(store: Store, key_file: str | None, location: str | None) -> bytes:
    if key_file is not None:
        try:
            with open(key_file, "rb") as f:
                key = f.read()
        except OSError as exc:
            raise NoiseKeyError(
                f"cannot read key file {key_file} ({exc.strerror}); pass the job's key file"
            ) from None
        if len(key) != 32:
            raise NoiseKeyError(f"key file {key_file} holds {len(key)} bytes, not a 32-byte key")
        return key
    key = store.get_secret(KEY_SECRET)
    if key is None:
        raise NoiseKeyError(
            f"{store.url} has no noise key (secret/{KEY_SECRET}; the job recorded key "
            f"location {location!r}): pass --key-file / key_file= to regenerate the noise"
        )
    return key


def _check_chain(store: Store, report: AuditReport) -> dict[int, Manifest]:
    manifests: dict[int, Manifest] = {}
    numbers = store.versions()
    for v in numbers:
        try:
            manifests[v] = store.manifest(v)
        except CorruptVersionError as exc:
            report.add("chain", str(exc), v)
    prev: Manifest | None = None
    for v, m in sorted(manifests.items()):
        if m.parent is not None:
            if m.parent >= v:
                report.add("chain", f"parent {m.parent} is not older than version {v}", v)
            elif m.parent in manifests and manifests[m.parent].step > m.step:
                report.add(
                    "chain",
                    f"step {m.step} is behind its parent {m.parent}'s step "
                    f"{manifests[m.parent].step}",
                    v,
                )
        elif prev is not None:
            report.add("chain", "has no parent although older versions exist", v)
        if prev is not None:
            g_prev = int(prev.writer.get("generation", 0))
            g = int(m.writer.get("generation", 0))
            if g < g_prev:
                report.add(
                    "chain", f"written by lease generation {g}, older than {g_prev} before it", v
                )
        # An array referenced from an older version must be that version's array.
        for name, meta in m.arrays.items():
            if meta.path.startswith(own_prefix(m)) or not meta.path.startswith("versions/"):
                continue
            try:
                src = int(meta.path.split("/")[1].split("-")[0])
            except (IndexError, ValueError):
                report.add("chain", f"array {name} lies at {meta.path}, not a version folder", v)
                continue
            old = manifests.get(src)
            if old is not None and name in old.arrays and old.arrays[name] != meta:
                report.add(
                    "chain",
                    f"array {name} references {meta.path} with metadata that differs from "
                    f"version {src}'s own",
                    v,
                )
        prev = m
    report.checks["chain"] = {"versions": len(numbers), "parsed": len(manifests)}
    return manifests


def _stored_bytes(store: Store, path: str) -> int:
    """Bytes the store holds under an array's folder (chunks and metadata)."""
    b = store.backend
    try:
        return int(b.retry.call(lambda: b.fs.du(b.path(path), total=True)))
    except FileNotFoundError:
        return 0


def _check_bounds(
    store: Store, manifests: dict[int, Manifest], report: AuditReport
) -> dict[int, VersionBounds]:
    """Every version's labels, shapes and counts against its config, and every array's
    recorded size against the bytes the store holds for it, before anything is read."""
    bounds: dict[int, VersionBounds] = {}
    sizes: dict[str, int] = {}
    for v, m in sorted(manifests.items()):
        vb = check_bounds(m)
        for p in vb.problems:
            report.add("bounds", p, v)
        for name, meta in m.arrays.items():
            if name in vb.unsafe:
                continue
            if meta.path not in sizes:
                sizes[meta.path] = _stored_bytes(store, meta.path)
            if meta.nbytes > sizes[meta.path]:
                vb.unsafe.add(name)
                report.add(
                    "bounds",
                    f"array {name} is recorded as {meta.dtype}{list(meta.shape)} "
                    f"({meta.nbytes} bytes) but the store holds {sizes[meta.path]} bytes "
                    f"at {meta.path}: the manifest claims more than was written",
                    v,
                )
        bounds[v] = vb
    report.checks["bounds"] = {
        "versions": len(bounds),
        "in_bounds": sum(vb.ok for vb in bounds.values()),
    }
    return bounds


def _check_checksums(
    store: Store,
    manifests: dict[int, Manifest],
    bounds: dict[int, VersionBounds],
    report: AuditReport,
) -> None:
    arrays = 0
    nbytes = 0
    seen: set[str] = set()
    for v, m in sorted(manifests.items()):
        ver = Version(store, m)
        for name in ver.array_names():
            if name in bounds[v].unsafe:
                continue  # reported by the bounds check; reading it could allocate anything
            meta = m.arrays[name]
            try:
                ver.array(name)
            except CorruptVersionError as exc:
                report.add("checksums", str(exc), v)
                continue
            if meta.path not in seen:
                seen.add(meta.path)
                arrays += 1
                nbytes += meta.nbytes
    report.checks["checksums"] = {"arrays": arrays, "bytes": nbytes}


def _check_records(
    manifests: dict[int, Manifest], bounds: dict[int, VersionBounds], report: AuditReport
) -> None:
    """Fingerprint, accountant, `complete` and internal consistency of each version's
    records."""
    fingerprints: set[str] = set()
    recomputed_eps = 0
    for v, m in sorted(manifests.items()):
        rec = m.records
        if not bounds[v].steps:
            continue  # the config cannot be read: reported by the bounds check
        try:
            cfg = rec["config"]
            dp = cfg["dp"]
            fp = cfgmod.fingerprint(cfg, rec["model_shapes"])
        except (KeyError, TypeError) as exc:
            report.add("fingerprint", f"config record is missing or malformed ({exc})", v)
            continue
        finished = m.step == int(dp["steps"])
        if rec.get("complete") is not finished:
            report.add(
                "complete",
                f"record complete={rec.get('complete')!r}, but the version is at step "
                f"{m.step} of {dp['steps']}: finished is {finished}",
                v,
            )
        fingerprints.add(fp)
        if rec.get("fingerprint") != fp or m.job_fingerprint != fp:
            report.add(
                "fingerprint",
                f"recorded fingerprint {rec.get('fingerprint')} / manifest "
                f"{m.job_fingerprint} do not match the config's {fp}",
                v,
            )
        acc = rec.get("accountant")
        if not isinstance(acc, dict):
            report.add("accountant", "accountant record is missing or not a mapping", v)
            continue
        want = {
            "noise_multiplier": float(dp["noise_multiplier"]),
            "dataset_size": int(dp["dataset_size"]),
            "batch_size": int(dp["batch_size"]),
            "bands": int(dp["bands"]),
            "delta": float(dp["delta"]),
            "steps": m.step,
        }
        for k, val in want.items():
            if acc.get(k) != val:
                report.add(
                    "accountant",
                    f"accountant record {k}={acc.get(k)!r}, but the config and step say {val!r}",
                    v,
                )
        if 0 < m.step <= bounds[v].steps:
            eps = compute_epsilon(
                want["noise_multiplier"],
                want["dataset_size"],
                want["batch_size"],
                m.step,
                want["bands"],
                want["delta"],
                acc.get("method", "pld"),
            )
            recomputed_eps += 1
            stored = acc.get("epsilon")
            if not isinstance(stored, (int, float)) or not math.isclose(
                stored, eps, rel_tol=1e-9, abs_tol=1e-12
            ):
                report.add(
                    "accountant",
                    f"stored epsilon {stored!r} differs from {eps!r} recomputed from the "
                    f"config for {m.step} steps",
                    v,
                )
        for name in ("trainer", "noise"):
            part = rec.get(name)
            got = part.get("step" if name == "trainer" else "t") if isinstance(part, dict) else None
            if got != m.step:
                report.add("chain", f"record {name} is at step {got}, the manifest at {m.step}", v)
    if len(fingerprints) > 1:
        report.add(
            "fingerprint",
            f"versions carry {len(fingerprints)} different job fingerprints "
            f"({sorted(fingerprints)}): a manifest from another job is in this store",
        )
    report.checks["accountant"] = {"epsilons_recomputed": recomputed_eps}
    report.checks["fingerprint"] = {"distinct": len(fingerprints)}


def _regenerate(
    key: bytes,
    mechanism: BandMF,
    dim: int,
    std: float,
    dtype: str,
    coords: np.ndarray,
    steps: int,
) -> np.ndarray:
    """w_t at `coords` for t < steps, (steps, len(coords)), computed the engine's way:
    the recursion is coordinate-wise, so a few coordinates need only their own history
    (their fresh noise blocks are drawn whole, as I1 defines them)."""
    fresh = KeyedNoise(key, dim, std, dtype)
    tdtype = fresh.dtype
    slots = mechanism.bands - 1
    c0 = float(mechanism.coefficients[0])
    blocks = np.unique(coords // BLOCK)
    out = torch.empty(steps, len(coords), dtype=tdtype)
    ring = torch.zeros(max(slots, 0), len(coords), dtype=tdtype)
    for t in range(steps):
        z = torch.empty(len(coords), dtype=tdtype)
        for k in blocks:
            lo, hi = int(k) * BLOCK, min((int(k) + 1) * BLOCK, dim)
            sel = np.nonzero(coords // BLOCK == k)[0]
            zb = fresh.fresh(t, lo, hi)
            z[sel] = zb[torch.from_numpy(coords[sel] - lo)]
        if slots:
            # the engine's kernel: one order of rounding, so any subset of coordinates
            # reproduces the stored values bit for bit
            w = (z - torch.from_numpy(mix_history(mechanism.mixing_vector(t), ring.numpy()))) / c0
            ring[t % slots].copy_(w)
        else:
            w = z / c0
        out[t] = w
    return out.numpy()


def _check_noise(
    store: Store,
    manifests: dict[int, Manifest],
    bounds: dict[int, VersionBounds],
    key: bytes,
    coordinates: int,
    seed: int,
    report: AuditReport,
) -> None:
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
    noise = rec["noise"]
    dim = int(noise["dim"])
    dp = rec["config"]["dp"]
    mechanism = BandMF.from_state_dict(rec["mechanism"])
    rng = np.random.default_rng(seed)
    k = min(coordinates, dim)
    coords = np.sort(rng.choice(dim, size=k, replace=False)).astype(np.int64)
    # Every stored slot, once per array path, from every readable version.
    stored: dict[str, tuple[int, int, np.ndarray, np.ndarray]] = {}
    for v, m in sorted(manifests.items()):
        if not bounds[v].noise_ok or m.records["noise"]["dim"] != dim:
            continue
        ver = Version(store, m)
        for shard in m.records["noise"]["shards"]:
            for _slot, step, name in shard["slots"]:
                meta = m.arrays.get(name)
                if meta is None or meta.path in stored or name in bounds[v].unsafe:
                    continue
                try:
                    arr = ver.array(name)
                except CorruptVersionError:
                    continue  # reported by the checksum check
                lo = int(shard["start"])
                inside = (coords >= lo) & (coords < int(shard["stop"]))
                stored[meta.path] = (v, int(step), inside, arr[coords[inside] - lo])
    steps = 1 + max((s for _, s, _, _ in stored.values()), default=-1)
    if steps == 0 or mechanism.bands == 1:
        report.checks["noise"] = {
            "coordinates": k,
            "seed": seed,
            "slots": 0,
            "note": "b = 1: no history is stored" if mechanism.bands == 1 else "no slots",
        }
        return
    want = _regenerate(
        key,
        mechanism,
        dim,
        float(dp["noise_multiplier"]) * float(dp["max_grad_norm"]),
        str(noise["dtype"]),
        coords,
        steps,
    )
    std = float(dp["noise_multiplier"]) * float(dp["max_grad_norm"])
    # float32: the engine and this recomputation may sum the b-1 terms in another order
    tol = (1e-5 if noise["dtype"] == "float32" else 1e-12) * std
    worst = 0.0
    identical = 0
    for path, (v, step, inside, got) in sorted(stored.items()):
        exp = want[step][inside]
        dev = float(np.max(np.abs(got.astype(np.float64) - exp.astype(np.float64)), initial=0.0))
        worst = max(worst, dev)
        identical += int(np.array_equal(got, exp))
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


def _check_embedding(
    store: Store,
    newest: Manifest,
    key: bytes,
    rows_per_table: int,
    seed: int,
    report: AuditReport,
    parts: JobParts | None,
) -> None:
    """Each table's online ring against noise regenerated from the table's key; with the
    job's parts (given by the caller, never resolved from the store), the stored noise
    order and CSC structure against the schedule rebuilt from the sampler and data, and
    the entries of random cold rows against a precompute from the key (tiling-
    independent, so bit for bit)."""
    from .config import JobConfig
    from .embedding.csc import CoalescedCSC
    from .embedding.precompute import precompute_csc, table_key, table_noise
    from .embedding.schedule import table_schedule
    from .layout import emb_name
    from .sampler import CyclicPoissonSampler

    emb = newest.records["embedding"]
    config = JobConfig.from_record(newest.records["config"])
    dp = config.dp
    mechanism = BandMF.from_state_dict(newest.records["mechanism"])
    std = dp.noise_multiplier * dp.max_grad_norm
    ver = Version(store, newest)
    rng = np.random.default_rng(seed)
    slots_checked = slots_identical = 0
    for t in emb["tables"]:
        ring_checked, ring_same = _check_table_ring(
            ver, t, table_key(key, t["param"]), mechanism, std, rng, report
        )
        slots_checked += ring_checked
        slots_identical += ring_same
    report.checks["embedding"] = {
        "tables": len(emb["tables"]),
        "threat_model": emb["threat_model"],
        "online_slots": slots_checked,
        "online_slots_bit_identical": slots_identical,
        "seed": seed,
    }
    if parts is None:
        report.skipped.append(
            f"embedding schedule: the noise order, CSC structure and cold rows' entries of "
            f"{len(emb['tables'])} tables need the job's data (job {config.job!r} is named by "
            "the store, and audit runs no code a store names): pass --job MODULE:FUNCTION or "
            "--example NAME (job= in Python) to check them"
        )
        return
    specs = {s.param: s for s in (config.embedding.tables if config.embedding else ())}
    specs = specs or {s.param: s for s in parts.tables}
    sampler = CyclicPoissonSampler(
        dataset_size=dp.dataset_size, batch_size=dp.batch_size, bands=dp.bands, seed=dp.seed
    )
    batches = sampler.schedule(dp.steps)
    checked = identical = 0
    for t in emb["tables"]:
        param, plan = t["param"], t["plan"]
        spec = specs.get(param)
        if spec is None:
            report.add(
                "embedding",
                f"table {param} of the store is not a table of the job given",
                newest.version,
            )
            continue
        sched = table_schedule(
            parts.data[spec.data_index][:, spec.column].numpy(), batches, int(t["rows"])
        )
        order = sched.noise_order()
        if not np.array_equal(ver.array(emb_name(param, "order")), order):
            report.add(
                "embedding",
                f"table {param}: the stored noise order differs from the one the job's "
                "sampler and data give",
                newest.version,
            )
            continue
        if plan["mode"] != "coalesced" or t.get("csc") is None:
            continue
        csc = CoalescedCSC.from_arrays(
            {k: ver.array(emb_name(param, f"csc/{k}")) for k in ("col_ptr", "rows", "values")}
        )
        hot = int(plan["hot"])
        hot_rows = set(order[:hot].tolist())
        for step in range(sched.steps):
            rows, _ = csc.column(step)
            want = [r for r in sched.rows_at(step).tolist() if r not in hot_rows]
            if rows.tolist() != want:
                report.add(
                    "embedding",
                    f"table {param}: CSC column {step} holds rows {rows.tolist()[:8]}..., the "
                    f"schedule's cold reads are {want[:8]}...",
                    newest.version,
                )
                break
        cold = np.arange(hot, sched.rows)
        if cold.size == 0:
            continue
        pick = np.sort(rng.choice(cold, size=min(rows_per_table, cold.size), replace=False))
        dim = int(t["dim"])
        dtype = str(csc.values.dtype)
        again = precompute_csc(
            sched,
            order,
            hot,
            dim,
            mechanism,
            table_noise(key, param, sched.rows, dim, std, dtype),
            np.asarray(
                config.embedding.lr_schedule
                if config.embedding and config.embedding.lr_schedule
                else [config.lr] * dp.steps
            )
            / dp.batch_size,
            tiles=[np.array([p]) for p in pick],
        )
        # both CSCs list entries by (column, row): the picked rows' entries line up
        mask = np.isin(csc.rows, order[pick])
        cols = np.repeat(np.arange(csc.steps + 1), np.diff(csc.col_ptr))[mask]
        exp_cols = np.repeat(np.arange(again.steps + 1), np.diff(again.col_ptr))
        same = 0
        if cols.size == exp_cols.size:
            ok = (cols == exp_cols) & (csc.rows[mask] == again.rows)
            ok &= np.all(csc.values[mask] == again.values, axis=1)
            same = int(ok.sum())
        checked += int(exp_cols.size)
        identical += same
        if same != exp_cols.size:
            report.add(
                "embedding",
                f"table {param}: of {exp_cols.size} entries of {len(pick)} random cold rows "
                f"recomputed from the key, {exp_cols.size - same} differ from the stored CSC: "
                "the coalesced noise was altered or came from another key",
                newest.version,
            )
    report.checks["embedding"].update({"entries_recomputed": checked, "bit_identical": identical})


def _check_table_ring(
    ver: Version,
    t: dict[str, Any],
    key: bytes,
    mechanism: BandMF,
    std: float,
    rng: np.random.Generator,
    report: AuditReport,
) -> tuple[int, int]:
    """A table's stored online ring (hot rows, or every row of a dense table) against
    the noise regenerated from the table's key at random coordinates of its noise space."""
    width = int(t["online_rows"]) * int(t["dim"])
    if width == 0 or not t["slots"]:
        return 0, 0
    coords = np.sort(rng.choice(width, size=min(64, width), replace=False)).astype(np.int64)
    steps = 1 + max(int(step) for _, step, _ in t["slots"])
    got = {step: ver.array(name) for _, step, name in t["slots"]}
    dtype = str(next(iter(got.values())).dtype)
    want = _regenerate(key, mechanism, int(t["rows"]) * int(t["dim"]), std, dtype, coords, steps)
    same = 0
    for step, arr in sorted(got.items()):
        if np.array_equal(arr[coords], want[step]):
            same += 1
        else:
            report.add(
                "embedding",
                f"table {t['param']}: online ring slot of step {step} differs from the noise "
                "regenerated from the key: the stored history was altered",
                ver.version,
            )
    return len(got), same


def _check_permissions(store: Store, report: AuditReport) -> None:
    """Who besides the owner can read what, following links (`cocoon_ckpt.exposure`)."""
    b = store.backend
    if not b.capabilities.permissions:
        report.info["readable_by"] = (
            f"{b.protocol}:// store: access is governed by the bucket or service policy, "
            "which this audit cannot see; check it grants the job's principal only"
        )
        return
    root = b.path("")
    found = walk_exposure(root)
    exposed = found.exposed
    who = [f"{c} ({len(v)} paths)" for c, v in exposed.items() if v]
    report.info["readable_by"] = f"owner uid {os.stat(root).st_uid}" + (
        " and " + ", ".join(who) if who else " only"
    )
    report.checks["permissions"] = {
        "paths": found.checked,
        "exposed_to_group": len(exposed["group"]),
        "exposed_to_others": len(exposed["others"]),
        "links_out": len(found.links_out),
    }
    for c, paths in exposed.items():
        if paths:
            shown = ", ".join(sorted(paths)[:3])
            report.add(
                "permissions",
                f"{len(paths)} paths can be read by {c} (e.g. {shown}); the noise history "
                f"and key undo the privacy to whoever reads them: chmod -R go-rwx {root}"
                + (" and each target of a link that leaves the store" if found.links_out else ""),
            )
    if found.links_out:
        shown = ", ".join(f"{a} -> {t}" for a, t in found.links_out[:3])
        report.add(
            "permissions",
            f"{len(found.links_out)} links lead out of the store ({shown}): who can read "
            "what they point to is decided outside the store; move the data into the store",
        )


def _job_parts(
    job: str | Callable[..., JobParts] | None, config_record: dict[str, Any]
) -> JobParts | None:
    """The caller's job built with the store's config; None when none was given."""
    if job is None:
        return None
    from .config import JobConfig

    builder = resolve(job) if isinstance(job, str) else job
    return builder(JobConfig.from_record(config_record))


def _check_job_shapes(parts: JobParts, newest: Manifest, report: AuditReport) -> None:
    shapes = {k: list(v.shape) for k, v in parts.model.state_dict().items()}
    if shapes != newest.records.get("model_shapes"):
        report.add(
            "job",
            "the job given builds a model of other shapes than the store records: it is "
            "not this store's job, so the checks that use its data compare the wrong thing",
            newest.version,
        )


def _guard(report: AuditReport, check: str, run: Callable[[], None]) -> None:
    """Run one check; records of the wrong type or shape are a finding, never a crash."""
    try:
        run()
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
        report.add(check, f"records cannot be checked ({type(exc).__name__}: {exc})")


def audit_store(
    url: str,
    *,
    coordinates: int = 256,
    key_file: str | None = None,
    seed: int | None = None,
    storage_options: dict[str, Any] | None = None,
    plot_dir: str | None = None,
    job: str | Callable[..., JobParts] | None = None,
) -> AuditReport:
    """Check everything a store claims (see the module docstring). Changes nothing and
    runs no code the store names.

    Args:
        url: store URL.
        coordinates: how many random coordinates of the noise to regenerate over all
            steps and compare with every stored ring slot (all if >= the model size).
        key_file: the noise key, for jobs that kept it outside the store.
        seed: seed of the coordinate choice (random by default, so what is audited
            cannot be predicted; the report names it so a run can be repeated).
        storage_options: fsspec options.
        plot_dir: also write PNG plots there (see `cocoon_ckpt.plots`).
        job: the job whose data the embedding schedule checks need, as a builder or
            `example:NAME` / `module:function`; it is built with the store's config.
            Without it those checks are skipped and listed in `AuditReport.skipped`.

    Raises:
        StoreNotFoundError: `url` holds no store.
        NoiseKeyError: no key in the store and none given, or an unreadable key file.
        ValueError: coordinates or seed out of range.
    """
    if coordinates < 1:
        raise ValueError(f"coordinates={coordinates} must be >= 1")
    if seed is not None and seed < 0:
        raise ValueError(f"seed={seed} must be >= 0")
    store = Store.open(url, storage_options=storage_options, create=False)
    report = AuditReport(store=url)
    manifests = _check_chain(store, report)
    if not manifests:
        raise StoreError(f"{url} has no readable version to audit; run a job against it first")
    newest = manifests[max(manifests)]
    rec = newest.records
    key = _load_audit_key(store, key_file, rec.get("key_location"))
    bounds = _check_bounds(store, manifests, report)
    _check_checksums(store, manifests, bounds, report)
    _guard(report, "accountant", lambda: _check_records(manifests, bounds, report))
    seed = secrets.randbits(63) if seed is None else seed
    _guard(
        report,
        "noise",
        lambda: _check_noise(store, manifests, bounds, key, coordinates, seed, report),
    )
    parts = None
    if job is not None:
        parts = _job_parts(job, rec["config"])
        _check_job_shapes(parts, newest, report)
        report.info["job"] = job if isinstance(job, str) else getattr(job, "__qualname__", "?")
    if rec.get("embedding") is not None:
        if bounds[newest.version].embedding_ok:
            _guard(
                report,
                "embedding",
                lambda: _check_embedding(store, newest, key, 4, seed, report, parts),
            )
        else:
            report.skipped.append(
                "embedding: the newest version's embedding records are out of bounds (see "
                "the bounds findings); nothing was recomputed"
            )
    _check_permissions(store, report)
    _guard(report, "privacy", lambda: _privacy_info(store, newest, bounds, key_file, report))
    if plot_dir is not None:
        from .plots import write_plots

        usable = {v: m for v, m in manifests.items() if bounds[v].noise_ok}
        if usable:
            skip = {m.arrays[n].path for v, m in usable.items() for n in bounds[v].unsafe}
            report.plots = write_plots(store, usable, plot_dir, skip_paths=skip)
        else:
            report.skipped.append("plots: no version's records are within bounds")
    return report


def _privacy_info(
    store: Store,
    newest: Manifest,
    bounds: dict[int, VersionBounds],
    key_file: str | None,
    report: AuditReport,
) -> None:
    rec = newest.records
    tm = rec.get("threat_model", THREAT_MODEL_DEFAULT)
    report.info.update(
        {
            "threat_model": f"{tm}: {THREAT_MODELS.get(tm, 'unknown')}",
            "key": (
                f"in the store (secret/{KEY_SECRET}): whoever can read the store can remove "
                "the noise"
                if store.get_secret(KEY_SECRET) is not None
                else f"not in the store (kept in a key file{'' if key_file else '?'})"
            ),
        }
    )
    if not bounds[newest.version].steps:
        return
    dp = rec["config"]["dp"]
    method = str(rec["accountant"].get("method", "pld"))
    eps = (
        compute_epsilon(
            float(dp["noise_multiplier"]),
            int(dp["dataset_size"]),
            int(dp["batch_size"]),
            newest.step,
            int(dp["bands"]),
            float(dp["delta"]),
            method,
        )
        if 0 < newest.step <= bounds[newest.version].steps
        else 0.0
    )
    g = describe(rec, steps_done=newest.step, epsilon=eps, accounting_method=method)
    report.info["epsilon"] = (
        f"{eps} at delta {g['delta']} after {newest.step} of {g['steps_planned']} steps "
        f"(recomputed from the config), under {g['neighbouring_relation']} adjacency"
    )
    report.info["privacy"] = g
