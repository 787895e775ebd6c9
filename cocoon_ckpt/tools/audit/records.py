"""The audit of each version's records against its config: the job fingerprint, the
`complete` flag (derived from the step count), the accountant record and its epsilon
(recomputed from the config, never taken from the record), and the trainer's and
noise's step against the manifest's, and the metrics record (its points before the
version's step, a parent's curve a prefix of its child's)."""

from __future__ import annotations

import functools
import json
import math
from typing import Any

from cocoon_ckpt.dp.accounting.amplified import epsilon_of_run
from cocoon_ckpt.format.fingerprint import fingerprint
from cocoon_ckpt.format.metrics import METRICS_RECORD, MetricsError, Series, read_metrics
from cocoon_ckpt.tools.audit.report import AuditReport
from cocoon_ckpt.tools.bounds import VersionBounds
from state import Manifest

__all__ = ["check_metrics", "check_records", "config_epsilon"]


def config_epsilon(
    dp: dict[str, Any], steps: int, method: str, mechanism: dict[str, Any] | None = None
) -> float:
    """Epsilon after `steps` steps, from the config's dp record and the version's
    mechanism record (a BLT run is accounted as one Gaussian, `dp.blt.accounting`).

    Args:
        dp: the `dp` mapping of a config record.
        steps: steps taken (>= 1).
        method: the accountant's method (`pld`, ...).
        mechanism: the version's `mechanism` record (None: BandMF).
    """
    return epsilon_of_run(dp, mechanism, steps, method)


def check_records(
    manifests: dict[int, Manifest], bounds: dict[int, VersionBounds], report: AuditReport
) -> None:
    """Fingerprint, accountant, `complete` and internal consistency of each version's
    records.

    Args:
        manifests: the parsed manifests, by version number.
        bounds: each version's bounds; a version whose config is unreadable is skipped
            (the bounds check reported it).
        report: where findings and the `accountant` and `fingerprint` counts go.

    Raises:
        KeyError, TypeError, ValueError: a record of the wrong type or shape (the
            caller turns these into a finding).
    """
    fingerprints: set[str] = set()
    recomputed_eps = 0
    for v, m in sorted(manifests.items()):
        rec = m.records
        if not bounds[v].steps:
            continue  # the config cannot be read: reported by the bounds check
        try:
            cfg = rec["config"]
            dp = cfg["dp"]
            fp = fingerprint(cfg, rec["model_shapes"], rec.get("identity"))
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
        recomputed_eps += _check_accountant(m, dp, acc, bounds[v].steps, report)
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
    _check_target(manifests[max(manifests)], report)
    check_metrics(manifests, report)


def _check_target(newest: Manifest, report: AuditReport) -> None:
    """A job given a target epsilon: the recorded sigma must meet it over the job's
    steps (derived from the config, not taken from the target's presence)."""
    try:
        dp = newest.records["config"]["dp"]
        target = dp.get("target_epsilon")
        if target is None:
            return
        method = str(newest.records.get("accountant", {}).get("method", "pld"))
        eps = config_epsilon(dp, int(dp["steps"]), method, newest.records.get("mechanism"))
    except (KeyError, TypeError, ValueError, AttributeError):
        return  # the config or accountant findings name what is malformed
    if not eps <= float(target) * (1 + 1e-9):
        report.add(
            "target",
            f"the recorded noise_multiplier={dp.get('noise_multiplier')!r} gives epsilon "
            f"{eps:.6g} after {dp['steps']} steps, above the recorded target_epsilon="
            f"{target!r}: the config was altered after calibration",
            newest.version,
        )


def check_metrics(manifests: dict[int, Manifest], report: AuditReport) -> None:
    """Each version's metrics record well formed (every point before its step, finite),
    and a parent's points exactly the child's points of the steps before the parent's.

    Args:
        manifests: the parsed manifests, by version number.
        report: where findings and the `metrics` counts go (versions with the record,
            points in the newest one).
    """
    curves: dict[int, dict[str, Series]] = {}
    for v, m in sorted(manifests.items()):
        if METRICS_RECORD not in m.records:
            continue  # written before metrics were stored
        try:
            curves[v] = read_metrics(m.records[METRICS_RECORD], m.step, f"version {v}")
        except MetricsError as exc:
            report.add("metrics", str(exc), v)
    for v, curve in curves.items():
        parent = manifests[v].parent
        if parent is None or parent not in curves:
            continue
        before = manifests[parent].step
        for name in sorted(set(curve) | set(curves[parent])):
            mine, theirs = curve.get(name, Series()), curves[parent].get(name, Series())
            n = sum(1 for t in mine.steps if t < before)
            if (mine.steps[:n], mine.values[:n]) != (theirs.steps, theirs.values):
                report.add(
                    "metrics",
                    f"metric {name} of the steps before {before} differs from version "
                    f"{parent}'s: a stored point was changed, dropped or added",
                    v,
                )
    newest = curves.get(max(manifests), {})
    report.checks["metrics"] = {
        "versions": len(curves),
        "points": sum(len(s) for s in newest.values()),
    }


def _check_accountant(
    m: Manifest, dp: dict[str, Any], acc: dict[str, Any], steps: int, report: AuditReport
) -> int:
    """The accountant record's parameters against the config and step, and its stored
    epsilon against one recomputed from the config when the step is within the config's
    `steps`. A mid-run version stores none (nothing to compare); the version at the
    job's last step must.

    Returns:
        1 when epsilon was recomputed, else 0.
    """
    v = m.version
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
    mech = m.records.get("mechanism")
    if isinstance(mech, dict) and mech.get("kind") == "BLT":
        sens = _blt_sensitivity(
            json.dumps(mech, sort_keys=True), int(dp["steps"]), int(dp["bands"])
        )
        if acc.get("sensitivity") != sens:
            report.add(
                "accountant",
                f"accountant record sensitivity={acc.get('sensitivity')!r}, but the stored "
                f"BLT's min-sep sensitivity at {dp['steps']} steps and {dp['bands']} bands is "
                f"{sens!r}: the BLT or the accountant was changed after the run accounted it",
                v,
            )
    if not 0 < m.step <= steps:
        return 0
    stored = acc.get("epsilon")
    if stored is None:
        # Written mid-run: only the job's last version stores its epsilon (the others
        # store the accountant's parameters, checked above, and readers compose it
        # from the config).
        if m.step == steps:
            report.add(
                "accountant",
                f"version at the job's last step {steps} stores no epsilon; the writer "
                "stores it in the last version",
                v,
            )
        return 0
    eps = config_epsilon(dp, m.step, str(acc.get("method", "pld")), m.records.get("mechanism"))
    if not isinstance(stored, (int, float)) or not math.isclose(
        stored, eps, rel_tol=1e-9, abs_tol=1e-12
    ):
        report.add(
            "accountant",
            f"stored epsilon {stored!r} differs from {eps!r} recomputed from the "
            f"config for {m.step} steps",
            v,
        )
    return 1


@functools.lru_cache(maxsize=4)
def _blt_sensitivity(mechanism: str, steps: int, bands: int) -> float:
    """The min-sep sensitivity of a stored BLT (its record as canonical JSON: every
    version of a run stores the same one, computed once)."""
    from cocoon_ckpt.dp.blt.accounting import accounting_sensitivity
    from cocoon_ckpt.dp.blt.strategy import BLT

    return accounting_sensitivity(BLT.from_state_dict(json.loads(mechanism)), steps, bands)
