"""The audit of who can read a store: on a local store, every path's mode (following
links, `cocoon_ckpt.tools.exposure`); on an object store, a note that its access policy
lies outside what the audit can see."""

from __future__ import annotations

import os

from cocoon_ckpt.tools.audit.report import AuditReport
from cocoon_ckpt.tools.exposure import walk_exposure
from state import Store

__all__ = ["check_permissions"]


def check_permissions(store: Store, report: AuditReport) -> None:
    """Who besides the owner can read what, following links (`cocoon_ckpt.tools.exposure`).

    Args:
        store: the audited store.
        report: where findings, `info["readable_by"]` and the `permissions` counts go.
    """
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
