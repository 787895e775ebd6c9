"""Running the audit: opening the store, loading the key, the order of the checks (each
later check uses only what the earlier ones found safe to read), the job the caller
names for the checks that need its data, and the plots."""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Any

from cocoon_ckpt.errors import ConfigError
from cocoon_ckpt.keys import load_key, manifest_mac_key, wrong_key
from cocoon_ckpt.tools.audit.arrays import check_checksums, check_store_bounds
from cocoon_ckpt.tools.audit.chain import check_chain
from cocoon_ckpt.tools.audit.embedding import check_embedding
from cocoon_ckpt.tools.audit.noise import check_noise
from cocoon_ckpt.tools.audit.permissions import check_permissions
from cocoon_ckpt.tools.audit.privacy import privacy_info
from cocoon_ckpt.tools.audit.records import check_records
from cocoon_ckpt.tools.audit.report import AuditReport
from cocoon_ckpt.train.parts import JobParts, resolve
from state import (
    ForgedVersionError,
    Manifest,
    Store,
    StoreError,
    UnauthenticatedVersionError,
)

__all__ = ["audit_store"]


def _check_macs(
    store: Store, manifests: dict[int, Manifest], key: bytes, report: AuditReport
) -> list[int]:
    """Every version's MACs under the job's key: a forged record is named; a version
    without MACs is a finding too, since only the unkeyed checksums vouch for it
    (written before store format 4, or stripped: certainly stripped when an older
    version is sealed). A key under which no version verifies and whose id is not the
    store's is named once as another job's key. Returns the versions that verify."""
    wrong = wrong_key(store, key)
    if wrong is not None:
        report.add("key", str(wrong))
        report.info["authenticated_versions"] = []
        return []
    mac_key = manifest_mac_key(key)
    sealed: list[int] = []
    for v, m in sorted(manifests.items()):
        try:
            m.authenticate(mac_key, where=store.url)
            sealed.append(v)
        except UnauthenticatedVersionError as exc:
            why = (
                f"version {sealed[-1]} before it is sealed, so its MACs were stripped"
                if sealed
                else "anyone who can write the store could have written it"
            )
            report.add("authentication", f"{exc}; {why}", v)
        except ForgedVersionError as exc:
            report.add("authentication", str(exc), v)
    report.info["authenticated_versions"] = sealed
    return sealed


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
    """Check everything a store claims (see `cocoon_ckpt.tools.audit`). Changes nothing
    and runs no code the store names.

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
        raise ConfigError(f"coordinates={coordinates} must be >= 1")
    if seed is not None and seed < 0:
        raise ConfigError(f"seed={seed} must be >= 0")
    if plot_dir is not None:
        from cocoon_ckpt.tools.plots import require_matplotlib

        require_matplotlib()  # refuse before the audit's work, not after it
    store = Store.open(url, storage_options=storage_options, create=False)
    report = AuditReport(store=url)
    manifests = check_chain(store, report)
    if not manifests:
        raise StoreError(f"{url} has no readable version to audit; run a job against it first")
    newest = manifests[max(manifests)]
    rec = newest.records
    key = load_key(store, key_file)
    sealed = _check_macs(store, manifests, key, report)
    if sealed and newest.version not in sealed:
        # what the audit reports of the job (privacy, epsilon, embedding) comes from the
        # newest version the key vouches for, never from one it found forged
        newest = manifests[max(sealed)]
        rec = newest.records
    bounds = check_store_bounds(store, manifests, report)
    check_checksums(store, manifests, bounds, report)
    _guard(report, "accountant", lambda: check_records(manifests, bounds, report))
    seed = secrets.randbits(63) if seed is None else seed
    _guard(
        report,
        "noise",
        lambda: check_noise(store, manifests, bounds, key, coordinates, seed, report),
    )
    parts: JobParts | None = None
    if job is not None:
        parts = _job_parts(job, rec["config"])
        _check_job_shapes(parts, newest, report)
        report.info["job"] = (
            job
            if isinstance(job, str)
            else f"{getattr(job, '__module__', '?')}:{getattr(job, '__qualname__', '?')}"
        )
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
    check_permissions(store, report)
    _guard(report, "privacy", lambda: privacy_info(store, newest, bounds, key_file, report))
    if plot_dir is not None:
        from cocoon_ckpt.tools.plots import write_plots

        usable = {v: m for v, m in manifests.items() if bounds[v].noise_ok}
        if usable:
            skip = {m.arrays[n].path for v, m in usable.items() for n in bounds[v].unsafe}
            report.plots = write_plots(store, usable, plot_dir, skip_paths=skip)
        else:
            report.skipped.append("plots: no version's records are within bounds")
    return report
