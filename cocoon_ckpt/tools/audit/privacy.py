"""What the audit reports about the privacy a store gives (informational, not checks):
the threat model, where the noise key lies, and epsilon recomputed from the config
with the guarantee it stands for (`cocoon_ckpt.tools.guarantee`)."""

from __future__ import annotations

from cocoon_ckpt.layout import KEY_SECRET, THREAT_MODEL_DEFAULT, THREAT_MODELS
from cocoon_ckpt.tools.audit.records import config_epsilon
from cocoon_ckpt.tools.audit.report import AuditReport
from cocoon_ckpt.tools.bounds import VersionBounds
from cocoon_ckpt.tools.guarantee import describe
from state import Manifest, Store

__all__ = ["privacy_info"]


def privacy_info(
    store: Store,
    newest: Manifest,
    bounds: dict[int, VersionBounds],
    key_file: str | None,
    report: AuditReport,
) -> None:
    """Fill `report.info` with the newest version's threat model, key location, epsilon
    and guarantee.

    Args:
        store: the audited store.
        newest: the newest readable version's manifest.
        bounds: each version's bounds; epsilon is left out when the newest config is
            unreadable.
        key_file: the key file the caller gave, if any.
        report: where the info goes.
    """
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
        config_epsilon(dp, newest.step, method, rec.get("mechanism"))
        if 0 < newest.step <= bounds[newest.version].steps
        else 0.0
    )
    g = describe(rec, steps_done=newest.step, epsilon=eps, accounting_method=method)
    report.info["epsilon"] = (
        f"{eps} at delta {g['delta']} after {newest.step} of {g['steps_planned']} steps "
        f"(recomputed from the config), under {g['neighbouring_relation']} adjacency"
    )
    report.info["privacy"] = g
