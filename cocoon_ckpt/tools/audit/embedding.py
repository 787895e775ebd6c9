"""Audit of an embedding job's noise: the tables' online rings regenerated from each
table's key, and (with the job's data, given by the caller) the noise order, CSC
structure and cold rows' entries recomputed from the schedule and the key. A CSC is
walked once, a window at a time where the tools stream it (`tools.csc_reads`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from torch.utils.data import TensorDataset

from cocoon_ckpt.dp.mechanism import BandMF
from cocoon_ckpt.format.ring_rows import slot_refs, slot_values
from cocoon_ckpt.records import EmbeddingRecord, TableRecord
from cocoon_ckpt.tools import csc_reads
from cocoon_ckpt.tools.audit.report import AuditReport
from cocoon_ckpt.tools.regenerate import regenerate_rows
from cocoon_ckpt.train.parts import JobParts
from state import Manifest, Store, Version

if TYPE_CHECKING:
    from cocoon_ckpt.embedding.schedule import AccessSchedule

__all__ = ["check_embedding"]


def check_embedding(
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
    independent, so bit for bit).

    Args:
        store: the audited store.
        newest: the newest readable version's manifest (its embedding records are in
            bounds).
        key: the job's 32-byte noise key (each table's key is derived from it).
        rows_per_table: how many random cold rows of each table to recompute.
        seed: seed of the coordinate and row choices.
        report: where findings, skipped checks and the `embedding` counts go.
        parts: the job the caller named, built with the store's config; None skips the
            schedule checks (listed in `report.skipped`).

    Raises:
        KeyError, TypeError, ValueError, IndexError, AttributeError: records of the
            wrong type or shape (the caller turns these into a finding).
    """
    from cocoon_ckpt.dp.sampler import CyclicPoissonSampler
    from cocoon_ckpt.embedding.precompute import precompute_csc, table_key, table_noise
    from cocoon_ckpt.embedding.schedule import table_schedule
    from cocoon_ckpt.layout import emb_name
    from cocoon_ckpt.train.config import JobConfig

    emb: EmbeddingRecord = newest.records["embedding"]
    config = JobConfig.from_record(newest.records["config"])
    dp = config.dp
    mechanism = BandMF.from_state_dict(newest.records["mechanism"])
    std = dp.sigma * dp.max_grad_norm
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
    # an embedding job's ids are tensors (the trainer refuses any other dataset)
    data = parts.dataset
    columns = data.tensors if isinstance(data, TensorDataset) else data
    if not isinstance(columns, (list, tuple)):
        report.add(
            "embedding",
            f"the job given holds a {type(data).__name__}, not tensors: an embedding job's "
            "ids must be tensors (a TensorDataset) for its schedule to be checked",
            newest.version,
        )
        return
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
            columns[spec.data_index][:, spec.column].numpy(), batches, int(t["rows"])
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
        hot = int(plan["hot"])
        cold = np.arange(hot, sched.rows)
        pick = (  # no draw for a table without cold rows, as the choices of the next depend on it
            np.sort(rng.choice(cold, size=min(rows_per_table, cold.size), replace=False))
            if cold.size
            else cold
        )
        found = _walk_csc(ver, param, sched, order, hot, order[pick], report)
        if found is None or cold.size == 0:
            continue
        cols, rows, values = found
        dim = int(t["dim"])
        dtype = str(values.dtype)
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
        exp_cols = np.repeat(np.arange(again.steps + 1), np.diff(again.col_ptr))
        same = 0
        if cols.size == exp_cols.size:
            ok = (cols == exp_cols) & (rows == again.rows)
            ok &= np.all(values == again.values, axis=1)
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


def _walk_csc(
    ver: Version,
    param: str,
    sched: AccessSchedule,
    order: np.ndarray,
    hot: int,
    picked: np.ndarray,
    report: AuditReport,
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """One pass over table `param`'s stored CSC, a window at a time where the tools
    stream it (`tools.csc_reads`): each step's column against the schedule's cold reads
    at that step (the first that differs is a finding), and the entries of the `picked`
    rows gathered in the CSC's (column, row) order.

    Returns:
        The picked rows' entries: (k,) int64 columns, (k,) int64 rows, (k, dim) values;
        None (and a finding) for a CSC of another step count than the schedule's.
    """
    csc = csc_reads.open_csc(ver, param)
    try:
        if csc.steps != sched.steps:
            report.add(
                "embedding",
                f"table {param}: the stored CSC has {csc.steps} steps, the schedule {sched.steps}",
                ver.version,
            )
            return None
        hot_rows = set(order[:hot].tolist())
        differs = False
        cols, rows, values = [], [], []
        for step, got, vals in csc_reads.columns(csc):
            if step < sched.steps and not differs:
                want = [r for r in sched.rows_at(step).tolist() if r not in hot_rows]
                if got.tolist() != want:
                    report.add(
                        "embedding",
                        f"table {param}: CSC column {step} holds rows {got.tolist()[:8]}..., "
                        f"the schedule's cold reads are {want[:8]}...",
                        ver.version,
                    )
                    differs = True
            if picked.size:
                mask = np.isin(got, picked)
                cols.append(np.full(int(np.count_nonzero(mask)), step, dtype=np.int64))
                rows.append(got[mask])
                values.append(vals[mask])
    finally:
        csc_reads.close(csc)
    if not cols:
        return np.empty(0, np.int64), np.empty(0, np.int64), np.empty((0, 0))
    return np.concatenate(cols), np.concatenate(rows), np.concatenate(values)


def _check_table_ring(
    ver: Version,
    t: TableRecord,
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
    refs = slot_refs(t["slots"], f"table {t['param']}")
    got = {ref.step: slot_values(ver, ref) for ref in refs}
    dtype = str(next(iter(got.values())).dtype)
    # each stored step's ring slot as the ring kept it
    held = [(step % (mechanism.bands - 1), step) for step in got]
    rows = regenerate_rows(key, mechanism, int(t["rows"]) * int(t["dim"]), std, dtype, coords, held)
    want = {step: rows[(slot, step)] for slot, step in held}
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
