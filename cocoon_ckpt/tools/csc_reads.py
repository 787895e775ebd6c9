"""A version's coalesced CSCs as the tools read them (`audit`, `export`), never whole
when the job read its CSC in windows or the CSC is large.

A CSC of a job that set `EmbeddingConfig.csc_window_steps`, or one larger than
`WHOLE_BYTES`, is verified chunk by chunk and its columns are read in windows, by
`embedding.csc_window`'s own reader and checks (`verify_part`, `CscWindows`): one chunk
of it in memory while it is verified, two windows while its columns are walked. A
smaller CSC of a job that held it whole is read whole, as the trainer holds it. Either
way every chunk's crc32c and each array's checksum are checked against the manifest
before a byte is used, and the columns are the same bytes in the same order.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from cocoon_ckpt.embedding.csc import CoalescedCSC
from cocoon_ckpt.embedding.csc_shards import whole_csc
from cocoon_ckpt.embedding.csc_window import CSC_PARTS, CscWindows, StoredCSC, verify_part
from cocoon_ckpt.format.stored import records_of
from cocoon_ckpt.layout import csc_array, emb_name
from state import CorruptVersionError, Manifest, Version

__all__ = [
    "WHOLE_BYTES",
    "WINDOW_BYTES",
    "close",
    "columns",
    "csc_part",
    "open_csc",
    "verify_array",
    "verify_version",
    "window_steps",
]

#: A CSC of a job that held it whole is read whole up to this size (rows and values).
WHOLE_BYTES = 64 << 20

#: The mean bytes of a window the tools pick for a larger CSC of such a job.
WINDOW_BYTES = 16 << 20


def csc_part(name: str) -> tuple[str, str] | None:
    """(param, part) of a one-process CSC's streamed array (`emb/<param>/csc/rows` or
    `.../csc/values`); None for any other array name (a rank's part included)."""
    parsed = csc_array(name)
    if parsed is None or parsed[1] is not None or parsed[2] == "col_ptr":
        return None
    return parsed[0], parsed[2]


def window_steps(manifest: Manifest, param: str) -> int | None:
    """Columns per window the tools read table `param`'s CSC in; None to read it whole.

    The job's own `csc_window_steps` where its config sets one; else, for a CSC of more
    than `WHOLE_BYTES`, as many columns as its mean column fits in `WINDOW_BYTES` (the
    tails are read in pieces no larger than the largest window). None for a smaller CSC,
    or one whose arrays have no recorded chunk shape (written before chunk shapes were
    recorded), which only a whole read knows.
    """
    metas = [manifest.arrays.get(emb_name(param, f"csc/{k}")) for k in CSC_PARTS]
    if any(m is None or m.chunks is None for m in metas):
        return None
    config = manifest.records.get("config")
    emb = config.get("embedding") if isinstance(config, dict) else None
    job = emb.get("csc_window_steps") if isinstance(emb, dict) else None
    if isinstance(job, int) and not isinstance(job, bool) and job >= 1:
        return job
    total = sum(m.nbytes for m in metas if m is not None)
    if total <= WHOLE_BYTES:
        return None
    cols = max(metas[0].shape[0] - 1, 1) if metas[0] is not None else 1  # n + 1 columns
    return max(1, WINDOW_BYTES * cols // total)


def verify_array(version: Version, name: str) -> None:
    """Array `name` of `version` read back and checked against its manifest entry: a
    streamed CSC's one chunk at a time (`csc_window.verify_part`, held nowhere), any
    other whole (`Version.array`, which keeps it for the next read).

    Raises:
        KeyError: the version has no array `name`.
        CorruptVersionError: it is missing, torn, of another shape or dtype, or fails
            its checksum; UnsafePathError: its path leaves the store.
    """
    part = csc_part(name)
    if part is None or window_steps(version.manifest, part[0]) is None:
        version.array(name)
        return
    try:
        verify_part(version, *part)
    except OSError as exc:  # a chunk file gone: what a whole read reports for it
        path = version.manifest.arrays[name].path
        raise CorruptVersionError(
            f"version {version.version} of {version.store.url}: array {path} cannot be read "
            f"({type(exc).__name__}: {exc}); it is missing or torn",
            version=version.version,
            path=path,
        ) from exc


def verify_version(version: Version) -> None:
    """Every array of `version` read and checked (`Version.verify`, the first bad one in
    name order raised), each streamed CSC one chunk at a time instead of whole."""

    def streamed(name: str) -> bool:
        part = csc_part(name)
        return part is not None and window_steps(version.manifest, part[0]) is not None

    version.verify(stream=streamed)


def open_csc(version: Version, param: str) -> CoalescedCSC | CscWindows:
    """Table `param`'s CSC in `version`, verified: read in windows (`window_steps`), or
    whole (several ranks' parts merged whole, `embedding.csc_shards.whole_csc`). Close
    it with `close`.

    Raises:
        KeyError: the version holds no CSC for `param`.
        CorruptVersionError: an array fails its checksum, or the arrays disagree with the
            column pointer.
        ValueError: a CSC read whole whose column pointer does not fit its entries.
    """
    emb = records_of(version).get("embedding")
    for table in emb["tables"] if emb else []:
        csc = table["csc"]
        if table["param"] == param and csc is not None and "parts" in csc:
            # written by several ranks: their parts merged, the one-process CSC's bits
            return whole_csc(version, param, dict(csc))
    steps = window_steps(version.manifest, param)
    if steps is not None:
        return CscWindows(StoredCSC.of_version(version, param), steps)
    return CoalescedCSC.from_arrays(
        {k: version.array(emb_name(param, f"csc/{k}")) for k in CSC_PARTS}
    )


def columns(csc: CoalescedCSC | CscWindows) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """Every column of `csc` in order as (t, rows, values); the tails (t = steps) in
    pieces of at most a window each, in row order (one after another they are the
    column), or whole from a CSC in memory."""
    for t in range(csc.steps):
        rows, values = csc.column(t)
        yield t, rows, values
    if isinstance(csc, CscWindows):
        for rows, values in csc.tail_pieces():
            yield csc.steps, rows, values
    else:
        rows, values = csc.column(csc.steps)
        yield csc.steps, rows, values


def close(csc: CoalescedCSC | CscWindows) -> None:
    """Stop a windowed CSC's prefetch thread and drop its windows."""
    if isinstance(csc, CscWindows):
        csc.close()
