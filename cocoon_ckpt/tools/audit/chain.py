"""The audit of the manifest chain: every manifest parsed, parents older and not ahead
in steps, lease generations never going back, and every array a version borrows from an
older version matching that version's own record of it, ring rows included (the same
step and checksum at the same row)."""

from __future__ import annotations

from cocoon_ckpt.format.ring_rows import rows_by_array
from cocoon_ckpt.tools.audit.report import AuditReport
from cocoon_ckpt.tools.catalog import own_prefix
from state import CorruptVersionError, Manifest, Store
from state.paths import version_of_path

__all__ = ["check_chain"]


def check_chain(store: Store, report: AuditReport) -> dict[int, Manifest]:
    """Parse every version's manifest and check the links between them.

    Args:
        store: the audited store.
        report: where findings and the `chain` counts go.

    Returns:
        The manifests that parsed, by version number.
    """
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
        _check_references(v, m, manifests, report)
        prev = m
    report.checks["chain"] = {"versions": len(numbers), "parsed": len(manifests)}
    return manifests


def _check_references(
    v: int, m: Manifest, manifests: dict[int, Manifest], report: AuditReport
) -> None:
    """An array version `v` references from an older version must be that version's
    array, and a ring row it borrows the row that version recorded."""
    rows = rows_by_array(m.records)
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
        if old is not None and name in rows:
            theirs = {
                (r.row, r.step, r.checksum) for _, r in rows_by_array(old.records).get(name, [])
            }
            for what, ref in rows[name]:
                if (ref.row, ref.step, ref.checksum) not in theirs:
                    report.add(
                        "chain",
                        f"{what} slot of step {ref.step} borrows row {ref.row} of {meta.path}, "
                        f"which version {src} records otherwise",
                        v,
                    )
