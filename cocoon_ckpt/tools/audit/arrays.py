"""The audit of a store's arrays before their contents are used: every version's
labels, shapes and counts against its config (`cocoon_ckpt.tools.bounds`), every
array's recorded size against the bytes the store holds for it, then every array in
bounds read back against its checksum; an array of ring rows that fails it is
narrowed to the slots whose rows fail their own checksums. A CSC the tools stream
(`tools.csc_reads`) is verified one chunk at a time, never held."""

from __future__ import annotations

from cocoon_ckpt.format.ring_rows import damaged_rows, rows_by_array
from cocoon_ckpt.tools import csc_reads
from cocoon_ckpt.tools.audit.report import AuditReport
from cocoon_ckpt.tools.bounds import VersionBounds, check_bounds
from state import CorruptVersionError, Manifest, Store, UnsafePathError, Version

__all__ = ["check_checksums", "check_store_bounds"]


def _stored_bytes(store: Store, path: str) -> int:
    """Bytes the store holds under an array's folder (chunks and metadata)."""
    b = store.backend
    try:
        return int(b.retry.call(lambda: b.fs.du(b.path(path), total=True)))
    except FileNotFoundError:
        return 0


def check_store_bounds(
    store: Store, manifests: dict[int, Manifest], report: AuditReport
) -> dict[int, VersionBounds]:
    """Every version's labels, shapes and counts against its config, and every array's
    recorded size against the bytes the store holds for it, before anything is read.

    Args:
        store: the audited store.
        manifests: the parsed manifests, by version number.
        report: where findings and the `bounds` counts go.

    Returns:
        Each version's bounds; an array whose recorded size exceeds what the store holds
        joins that version's `unsafe` names.
    """
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


def check_checksums(
    store: Store,
    manifests: dict[int, Manifest],
    bounds: dict[int, VersionBounds],
    report: AuditReport,
) -> None:
    """Read every array in bounds once per path and verify its checksum.

    Args:
        store: the audited store.
        manifests: the parsed manifests, by version number.
        bounds: each version's bounds; its `unsafe` arrays are never read.
        report: where findings and the `checksums` counts go.
    """
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
                csc_reads.verify_array(ver, name)  # a streamed CSC one chunk at a time
            except CorruptVersionError as exc:
                report.add("checksums", str(exc), v)
                if not isinstance(exc, UnsafePathError):
                    _name_damaged_slots(store, m, name, report)
                continue
            if meta.path not in seen:
                seen.add(meta.path)
                arrays += 1
                nbytes += meta.nbytes
    report.checks["checksums"] = {"arrays": arrays, "bytes": nbytes}


def _name_damaged_slots(store: Store, m: Manifest, name: str, report: AuditReport) -> None:
    """Which slots of array `name` (failed its checksum) are damaged, row by row."""
    rows = rows_by_array(m.records).get(name)
    if not rows:
        return
    meta = m.arrays[name]
    what = {ref: w for w, ref in rows}
    for ref in damaged_rows(store, meta, [r for _, r in rows]):
        report.add(
            "checksums",
            f"{what[ref]} slot of step {ref.step} (row {ref.row} of {meta.path}) fails its "
            "checksum: that slot of the stored history is damaged",
            m.version,
        )
