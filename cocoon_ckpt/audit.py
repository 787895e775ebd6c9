"""The audit of a store's noise state: what `cocoon-ckpt audit` prints and exits on.

The audit trusts nothing it reads: every manifest of the chain is parsed and every
array checksummed, the stored ring slots are compared with noise regenerated from the
key (so a slot rewritten with a valid checksum is still caught), epsilon is recomputed
from the configuration (not from the accountant record), and the fingerprint and key id
of every version are recomputed and compared.
"""

from __future__ import annotations

import math
import os
import secrets
import stat
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from state import CorruptVersionError, Manifest, Store, StoreError, Version

from . import config as cfgmod
from .accountant import epsilon as compute_epsilon
from .catalog import own_prefix
from .errors import NoiseKeyError
from .gemv import mix_history
from .job import key_id
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
            "plots": self.plots,
        }

    def text(self) -> str:
        lines = [f"audit of {self.store}: " + ("all checks hold" if self.ok else "FINDINGS")]
        for name, c in self.checks.items():
            detail = ", ".join(f"{k}={v}" for k, v in c.items())
            lines.append(f"  {name:<12} {detail}")
        for k, v in self.info.items():
            lines.append(f"  {k}: {v}")
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
            src = int(meta.path.split("/")[1].split("-")[0])
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


def _check_checksums(store: Store, manifests: dict[int, Manifest], report: AuditReport) -> None:
    arrays = 0
    nbytes = 0
    seen: set[str] = set()
    for v, m in sorted(manifests.items()):
        ver = Version(store, m)
        for name in ver.array_names():
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


def _check_records(manifests: dict[int, Manifest], report: AuditReport) -> None:
    """Fingerprint, accountant and internal consistency of each version's records."""
    fingerprints: set[str] = set()
    recomputed_eps = 0
    for v, m in sorted(manifests.items()):
        rec = m.records
        try:
            cfg = rec["config"]
            dp = cfg["dp"]
            fp = cfgmod.fingerprint(cfg, rec["model_shapes"])
        except (KeyError, TypeError) as exc:
            report.add("fingerprint", f"config record is missing or malformed ({exc})", v)
            continue
        fingerprints.add(fp)
        if rec.get("fingerprint") != fp or m.job_fingerprint != fp:
            report.add(
                "fingerprint",
                f"recorded fingerprint {rec.get('fingerprint')} / manifest "
                f"{m.job_fingerprint} do not match the config's {fp}",
                v,
            )
        acc = rec.get("accountant", {})
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
        if m.step > 0:
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
            got = rec.get(name, {}).get("step" if name == "trainer" else "t")
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
    key: bytes,
    coordinates: int,
    seed: int,
    report: AuditReport,
) -> None:
    newest = manifests[max(manifests)]
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
        ver = Version(store, m)
        for shard in m.records.get("noise", {}).get("shards", []):
            for _slot, step, name in shard["slots"]:
                meta = m.arrays.get(name)
                if meta is None or meta.path in stored:
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
    store: Store, newest: Manifest, key: bytes, rows_per_table: int, seed: int, report: AuditReport
) -> None:
    """Coalesced tables: the stored noise order and CSC structure against the schedule
    rebuilt from the job (sampler + data), and the entries of random cold rows against
    a precompute from the key (tiling-independent, so bit for bit)."""
    from .config import JobConfig
    from .embedding.csc import CoalescedCSC
    from .embedding.precompute import precompute_csc, table_key, table_noise
    from .embedding.schedule import table_schedule
    from .jobs import resolve
    from .layout import emb_name
    from .sampler import CyclicPoissonSampler

    emb = newest.records["embedding"]
    config = JobConfig.from_record(newest.records["config"])
    parts = resolve(config.job)(config)
    specs = {s.param: s for s in (config.embedding.tables if config.embedding else ())}
    specs = specs or {s.param: s for s in parts.tables}
    dp = config.dp
    sampler = CyclicPoissonSampler(
        dataset_size=dp.dataset_size, batch_size=dp.batch_size, bands=dp.bands, seed=dp.seed
    )
    batches = sampler.schedule(dp.steps)
    mechanism = BandMF.from_state_dict(newest.records["mechanism"])
    std = dp.noise_multiplier * dp.max_grad_norm
    ver = Version(store, newest)
    rng = np.random.default_rng(seed)
    checked = identical = slots_checked = slots_identical = 0
    for t in emb["tables"]:
        param, plan = t["param"], t["plan"]
        spec = specs[param]
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
        ring_checked, ring_same = _check_table_ring(
            ver, t, table_key(key, param), mechanism, std, rng, report
        )
        slots_checked += ring_checked
        slots_identical += ring_same
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
    report.checks["embedding"] = {
        "tables": len(emb["tables"]),
        "threat_model": emb["threat_model"],
        "entries_recomputed": checked,
        "bit_identical": identical,
        "online_slots": slots_checked,
        "online_slots_bit_identical": slots_identical,
        "seed": seed,
    }


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
    """Who besides the owner can read what: a path is exposed to group (others) when
    it has the read bit for them and every folder from the store root down to it has
    the search bit for them."""
    b = store.backend
    if not b.capabilities.permissions:
        report.info["readable_by"] = (
            f"{b.protocol}:// store: access is governed by the bucket or service policy, "
            "which this audit cannot see; check it grants the job's principal only"
        )
        return
    root = b.path("")
    classes = {"group": (stat.S_IRGRP, stat.S_IXGRP), "others": (stat.S_IROTH, stat.S_IXOTH)}
    exposed: dict[str, list[str]] = {c: [] for c in classes}
    checked = 0
    searchable = {c: {root: bool(os.stat(root).st_mode & x)} for c, (_, x) in classes.items()}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames]:
            p = os.path.join(dirpath, name)
            mode = os.lstat(p).st_mode
            checked += 1
            for c, (r, x) in classes.items():
                reach = searchable[c][dirpath]
                if name in dirnames:
                    searchable[c][p] = reach and bool(mode & x)
                if reach and mode & r:
                    exposed[c].append(os.path.relpath(p, root))
    st = os.stat(root)
    who = [f"{c} ({len(v)} paths)" for c, v in exposed.items() if v]
    report.info["readable_by"] = f"owner uid {st.st_uid}" + (
        " and " + ", ".join(who) if who else " only"
    )
    report.checks["permissions"] = {
        "paths": checked,
        "exposed_to_group": len(exposed["group"]),
        "exposed_to_others": len(exposed["others"]),
    }
    for c, paths in exposed.items():
        if paths:
            shown = ", ".join(sorted(paths)[:3])
            report.add(
                "permissions",
                f"{len(paths)} paths can be read by {c} (e.g. {shown}); the noise history "
                f"and key undo the privacy to whoever reads them: chmod -R go-rwx {root}",
            )


def audit_store(
    url: str,
    *,
    coordinates: int = 256,
    key_file: str | None = None,
    seed: int | None = None,
    storage_options: dict[str, Any] | None = None,
    plot_dir: str | None = None,
) -> AuditReport:
    """Check everything a store claims (see the module docstring). Changes nothing.

    Args:
        url: store URL.
        coordinates: how many random coordinates of the noise to regenerate over all
            steps and compare with every stored ring slot (all if >= the model size).
        key_file: the noise key, for jobs that kept it outside the store.
        seed: seed of the coordinate choice (random by default, so what is audited
            cannot be predicted; the report names it so a run can be repeated).
        storage_options: fsspec options.
        plot_dir: also write PNG plots there (see `cocoon_ckpt.plots`).

    Raises:
        StoreNotFoundError: `url` holds no store.
        NoiseKeyError: no key in the store and none given, or an unreadable key file.
    """
    if coordinates < 1:
        raise ValueError(f"coordinates={coordinates} must be >= 1")
    store = Store.open(url, storage_options=storage_options, create=False)
    report = AuditReport(store=url)
    manifests = _check_chain(store, report)
    if not manifests:
        raise StoreError(f"{url} has no readable version to audit; run a job against it first")
    newest = manifests[max(manifests)]
    rec = newest.records
    key = _load_audit_key(store, key_file, rec.get("key_location"))
    _check_checksums(store, manifests, report)
    _check_records(manifests, report)
    seed = secrets.randbits(63) if seed is None else seed
    try:
        _check_noise(store, manifests, key, coordinates, seed, report)
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        report.add("noise", f"noise records cannot be read ({type(exc).__name__}: {exc})")
    if rec.get("embedding") is not None:
        try:
            _check_embedding(store, newest, key, 4, seed, report)
        except (KeyError, TypeError, ValueError, IndexError, CorruptVersionError) as exc:
            report.add(
                "embedding", f"embedding records cannot be checked ({type(exc).__name__}: {exc})"
            )
    _check_permissions(store, report)
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
            "epsilon": f"{rec['accountant'].get('epsilon')} at delta "
            f"{rec['accountant'].get('delta')} after {newest.step} steps",
        }
    )
    if plot_dir is not None:
        from .plots import write_plots

        report.plots = write_plots(store, manifests, plot_dir)
    return report
