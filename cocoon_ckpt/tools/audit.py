"""The audit of a store's noise state: what `cocoon-ckpt audit` prints and exits on.

The audit trusts nothing it reads and executes nothing it reads (I7): every manifest of
the chain is parsed and every array checksummed, the stored ring slots are compared
with noise regenerated from the key (so a slot rewritten with a valid checksum is still
caught), epsilon is recomputed from the configuration (not from the accountant record),
"finished" is derived from the step count, and the fingerprint and key id of every
version are recomputed and compared. Every step label, shape and count is checked
against the config before any work or allocation depends on it (`cocoon_ckpt.tools.bounds`).
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

from cocoon_ckpt.dp.accountant import epsilon as compute_epsilon
from cocoon_ckpt.dp.mechanism import BandMF
from cocoon_ckpt.errors import NoiseKeyError
from cocoon_ckpt.keys import key_id
from cocoon_ckpt.layout import KEY_SECRET, THREAT_MODEL_DEFAULT, THREAT_MODELS
from cocoon_ckpt.tools.audit_embedding import check_embedding
from cocoon_ckpt.tools.bounds import VersionBounds, check_bounds
from cocoon_ckpt.tools.catalog import own_prefix
from cocoon_ckpt.tools.exposure import walk_exposure
from cocoon_ckpt.tools.guarantee import describe
from cocoon_ckpt.tools.regenerate import regenerate
from cocoon_ckpt.train import config as cfgmod
from cocoon_ckpt.train.parts import JobParts, resolve
from state import CorruptVersionError, Manifest, Store, StoreError, Version
from state.paths import version_of_path

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
    stored = store.get_secret(KEY_SECRET)
    if stored is None:
        raise NoiseKeyError(
            f"{store.url} has no noise key (secret/{KEY_SECRET}; the job recorded key "
            f"location {location!r}): pass --key-file / key_file= to regenerate the noise"
        )
    return stored


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
            src = version_of_path(meta.path)
            if src is None:
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
                float(dp["noise_multiplier"]),
                int(dp["dataset_size"]),
                int(dp["batch_size"]),
                m.step,
                int(dp["bands"]),
                float(dp["delta"]),
                str(acc.get("method", "pld")),
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
    want = regenerate(
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


def _check_permissions(store: Store, report: AuditReport) -> None:
    """Who besides the owner can read what, following links (`cocoon_ckpt.tools.exposure`)."""
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


def _job_parts(job: str | Callable[..., JobParts], config_record: dict[str, Any]) -> JobParts:
    """The caller's job built with the store's config."""
    from cocoon_ckpt.train.config import JobConfig

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
        plot_dir: also write PNG plots there (see `cocoon_ckpt.tools.plots`).
        job: the job whose data the embedding schedule checks need, as a builder or
            `example:NAME` / `module:function`; it is built with the store's config.
            Without it those checks are skipped and listed in `AuditReport.skipped`.

    Raises:
        StoreNotFoundError: `url` holds no store.
        NoiseKeyError: no key in the store and none given, or an unreadable key file.
        ValueError: coordinates or seed out of range.
        MissingExtraError: `plot_dir` is given and matplotlib is not installed.
    """
    if coordinates < 1:
        raise ValueError(f"coordinates={coordinates} must be >= 1")
    if seed is not None and seed < 0:
        raise ValueError(f"seed={seed} must be >= 0")
    if plot_dir is not None:
        from cocoon_ckpt.tools.plots import require_matplotlib

        require_matplotlib()  # refuse before the audit's work, not after it
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
    parts: JobParts | None = None
    if job is not None:
        parts = _job_parts(job, rec["config"])
        _check_job_shapes(parts, newest, report)
        report.info["job"] = job if isinstance(job, str) else getattr(job, "__qualname__", "?")
    if rec.get("embedding") is not None:
        if bounds[newest.version].embedding_ok:
            _guard(
                report,
                "embedding",
                lambda: check_embedding(store, newest, key, 4, seed, report, parts),
            )
        else:
            report.skipped.append(
                "embedding: the newest version's embedding records are out of bounds (see "
                "the bounds findings); nothing was recomputed"
            )
    _check_permissions(store, report)
    _guard(report, "privacy", lambda: _privacy_info(store, newest, bounds, key_file, report))
    if plot_dir is not None:
        from cocoon_ckpt.tools.plots import write_plots

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
