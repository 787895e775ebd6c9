"""One table's noise over a run: dense online, coalesced (hot online + CSC), or lazy.

Every path draws from the same keyed source (`table_noise`), so a coalesced table ends
where the dense mechanism would have put it (I5), up to rounding.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from cocoon_ckpt._state_dict import check_state
from cocoon_ckpt.dp.bandmf_noise import BandMFNoise
from cocoon_ckpt.dp.generator import NoiseRng
from cocoon_ckpt.dp.mechanism import BandMF
from cocoon_ckpt.embedding.config import TableMode, TableSpec
from cocoon_ckpt.embedding.csc import CoalescedCSC
from cocoon_ckpt.embedding.csc_assembly import CscAssembly
from cocoon_ckpt.embedding.csc_shards import (
    CscPart,
    CscRanks,
    PartWindows,
    StoredParts,
    load_range,
    part_bounds,
    part_entries,
    tile_edges,
)
from cocoon_ckpt.embedding.csc_window import CscWindows, StoredCSC
from cocoon_ckpt.embedding.lazy import LazyNoise
from cocoon_ckpt.embedding.one_thread import one_thread
from cocoon_ckpt.embedding.precompute import (
    TileEntries,
    TileLayout,
    TileParts,
    default_tile_rows,
    precompute_csc,
    precompute_into,
    table_key,
    table_noise,
)
from cocoon_ckpt.embedding.schedule import AccessSchedule
from cocoon_ckpt.embedding.stored_tiles import tile_digest
from cocoon_ckpt.errors import ConfigError, StoredStateError
from cocoon_ckpt.keys import key_id
from cocoon_ckpt.tiers.build import build_history
from cocoon_ckpt.tiers.config import TierConfig
from state import Store

__all__ = ["OffsetTiles", "TableEngine", "TablePlan"]

log = logging.getLogger(__name__)

_NP: dict[torch.dtype, type[np.floating]] = {torch.float32: np.float32, torch.float64: np.float64}


def by_row(parts: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Every rank's (rows, values) of one column as one column sorted by row, as the
    one-process column is (a row is in one rank's part only)."""
    every = np.concatenate([p[0] for p in parts])
    order = np.argsort(every, kind="stable")
    return every[order], np.concatenate([p[1] for p in parts])[order]


@dataclass(frozen=True, slots=True)
class TablePlan:
    """The path a table takes, fixed for the whole job (recorded in every manifest)."""

    mode: TableMode
    hot: int
    """H, rows with online history (the first H rows of the noise order)."""
    threshold: int | None
    """Rows read more than this many times are hot (None: not coalesced)."""
    profile: dict[str, Any]

    def to_record(self) -> dict[str, Any]:
        return {
            "mode": self.mode.value,
            "hot": self.hot,
            "threshold": self.threshold,
            "profile": self.profile,
        }

    @classmethod
    def from_record(cls, d: dict[str, Any]) -> TablePlan:
        return cls(TableMode(d["mode"]), int(d["hot"]), d["threshold"], dict(d["profile"]))


class TableEngine:
    """The noise of one embedding table.

    Args:
        spec: which parameter and which ids.
        rows, dim: the table's shape (R, dim).
        mechanism: the BandMF strategy.
        key: the job's 32-byte noise key (the table's key is derived from it).
        std: sigma * clip.
        dtype: the table's dtype.
        schedule: the table's reads over the run.
        factors: (n,) float64, lr_t / B.
        plan: the path (see `TablePlan`).
        tile_rows: precompute tile size (None: default).
        tiers: where the online history lives (`cocoon_ckpt.tiers`; None: the host).
        rng: the fresh noise's generator (`NoiseRng`), for the precompute and the online
            rows alike (the lazy b = 1 path draws its own, `LazyNoise`).
        csc_window_steps: read a committed CSC from the store in windows of this many
            steps (`embedding.csc_window`); None: hold it whole in memory.
    """

    def __init__(
        self,
        spec: TableSpec,
        rows: int,
        dim: int,
        mechanism: BandMF,
        key: bytes,
        std: float,
        dtype: torch.dtype,
        schedule: AccessSchedule,
        factors: np.ndarray,
        plan: TablePlan,
        tile_rows: int | None = None,
        tiers: TierConfig | None = None,
        rng: NoiseRng | str = NoiseRng.DEFAULT,
        csc_window_steps: int | None = None,
    ) -> None:
        if plan.mode is TableMode.AUTO:
            raise ValueError("a TablePlan's mode must be resolved (dense, coalesced or lazy)")
        if plan.mode is TableMode.LAZY and mechanism.bands != 1:
            raise ConfigError(
                f"table {spec.param}: mode='lazy' needs bands=1 (at b={mechanism.bands} the "
                "per-step noise is correlated and one Gaussian per gap is wrong); use "
                "mode='coalesced'"
            )
        self.spec = spec
        self.rows, self.dim = rows, dim
        self.mechanism = mechanism
        self.schedule = schedule
        self.factors = factors
        self.plan = plan
        self.dtype = dtype
        self.tile_rows = tile_rows
        self.order = schedule.noise_order()
        self.noise = table_noise(key, spec.param, rows, dim, std, dtype, rng)
        self._key_id = key_id(key)
        sub = table_key(key, spec.param)
        width = {TableMode.DENSE: rows, TableMode.COALESCED: plan.hot, TableMode.LAZY: 0}
        self.online_rows = width[plan.mode]
        self.online: BandMFNoise | None = None
        if self.online_rows:
            np_dtype = "float64" if dtype == torch.float64 else "float32"
            history = build_history(mechanism.bands - 1, self.online_rows * dim, np_dtype, tiers)
            self.online = BandMFNoise(
                mechanism,
                rows * dim,
                sub,
                std,
                dtype,
                stop=self.online_rows * dim,
                history=history,
                rng=rng,
            )
        self._online_index = torch.from_numpy(self.order[: self.online_rows])
        self.lazy = LazyNoise(sub, dim, std, factors) if plan.mode is TableMode.LAZY else None
        self.csc_window_steps = csc_window_steps
        self.csc: CoalescedCSC | CscWindows | PartWindows | None = None
        self.precompute_seconds = 0.0
        self.entries_applied = 0
        self.ranks: CscRanks | None = None
        self._offset = 0

    # several ranks ---------------------------------------------------------------
    def shard(self, ranks: CscRanks, offset: int = 0) -> None:
        """Precompute and hold only this rank's part of the CSC (`embedding.csc_shards`),
        and gather each step's column from every rank's part. Rank r holds part
        (r + offset) mod world: a job's tables pass their index, so tables of fewer
        tiles than ranks (whose later parts are empty) load different ranks. With
        `csc_window_steps`, a rank reads its own part in windows once a version holds
        it (`parts_committed`, or a resume on the same world size)."""
        if self.plan.mode is not TableMode.COALESCED or ranks.world == 1:
            return
        self.ranks = ranks
        self._offset = offset

    @property
    def my_part(self) -> tuple[int, int]:
        """[start, stop) of the cold slots this rank holds (all of them in one process)."""
        bounds = self.part_bounds
        if self.ranks is None:
            return bounds[0]
        return bounds[(self.ranks.rank + self._offset) % self.ranks.world]

    @property
    def part_bounds(self) -> list[tuple[int, int]]:
        """Every rank's [start, stop) of this table's cold slots (one range in one
        process)."""
        world = 1 if self.ranks is None else self.ranks.world
        return part_bounds(self.plan.hot, self.rows, self._tile_rows(), world)

    def _tile_rows(self) -> int:
        itemsize = np.dtype(self.noise.np_dtype).itemsize
        return self.tile_rows or default_tile_rows(self.dim, self.mechanism.bands, itemsize)

    def _part(self, csc: CoalescedCSC) -> CscPart:
        bounds = self.part_bounds
        counts = self.schedule.counts
        entries = [part_entries(counts, self.order, a, z) for a, z in bounds]
        return CscPart.of(csc, *self.my_part, bounds, entries)

    # the precompute --------------------------------------------------------------
    @property
    def needs_precompute(self) -> bool:
        return self.plan.mode is TableMode.COALESCED and self.csc is None

    def tile_digest(self, job_fingerprint: str | None) -> str:
        """A digest of everything that determines this table's precompute tiles: the
        key's id, the job's fingerprint, the plan (mode, H, threshold), the shape,
        dtype, noise scale and generator, the mechanism's coefficients and each step's
        mixing vector and scale, the per-step rates, the schedule, the noise order and
        the tiling. Tiles kept under another digest are never used."""
        mech = self.mechanism
        n = self.schedule.steps
        slots = mech.bands - 1
        mixes = np.zeros((n, slots), dtype=np.float64)
        for t in range(n if slots else 0):
            mixes[t] = mech.mixing_vector(t)
        fields = {
            "key_id": self._key_id,
            "job": job_fingerprint,
            "param": self.spec.param,
            "plan": {k: self.plan.to_record()[k] for k in ("mode", "hot", "threshold")},
            "rows": self.rows,
            "dim": self.dim,
            "dtype": str(self.noise.np_dtype),
            "std": repr(self.noise.std),
            "rng": self.noise.rng.value,
            "bands": mech.bands,
            "steps": n,
            "tile_rows": self.tile_rows,
        }
        return tile_digest(
            fields,
            {
                "coefficients": np.asarray(mech.coefficients, dtype=np.float64),
                "mixes": mixes,
                "scales": np.array([mech.noise_scale(t) for t in range(n)], dtype=np.float64),
                "factors": self.factors[:n],
                "order": self.order,
                "row_ptr": self.schedule.row_ptr,
                "row_steps": self.schedule.row_steps,
            },
        )

    def precompute(self, progress: Any = None, parts: TileParts | None = None) -> CoalescedCSC:
        """Build the CSC of the cold rows (slow: the whole run's noise for them); with
        `parts`, tiles kept there are loaded and each computed one is kept. On several
        ranks, this rank's run of tiles, kept under their index among all the table's
        tiles (`OffsetTiles`), so any world size finds them."""
        t0 = time.perf_counter()
        tiles = None
        if self.ranks is not None:  # this rank's tiles only
            a, z = self.my_part
            edges = tile_edges(self.plan.hot, self.rows, self._tile_rows())
            cuts = [e for e in edges if a <= e <= z]
            tiles = [np.arange(x, y, dtype=np.int64) for x, y in zip(cuts, cuts[1:], strict=False)]
            if parts is not None:
                parts = OffsetTiles(parts, edges.index(a))
        csc = precompute_csc(
            self.schedule,
            self.order,
            self.plan.hot,
            self.dim,
            self.mechanism,
            self.noise,
            self.factors,
            tile_rows=self.tile_rows,
            tiles=tiles,
            progress=progress,
            parts=parts,
        )
        self.csc = csc if self.ranks is None else self._part(csc)
        self.precompute_seconds = time.perf_counter() - t0
        return self.csc

    def precompute_to_store(
        self,
        store: Store,
        progress: Any = None,
        parts: TileParts | None = None,
        digest: str | None = None,
    ) -> CscWindows:
        """Build the CSC of the cold rows into `store` (`embedding.csc_assembly`), never
        whole in memory, and read it in windows of `csc_window_steps` from then on;
        the first version references it (the writer lease must be held). With
        `digest` (`tile_digest`), a killed attempt's arrays are replaced, not left.

        Raises:
            ValueError: `csc_window_steps` is not set.
        """
        window = self.csc_window_steps
        if window is None:
            raise ValueError(
                f"table {self.spec.param}: the CSC is assembled in the store only to be read "
                "in windows; set csc_window_steps"
            )
        t0 = time.perf_counter()
        assembly = CscAssembly(
            store,
            self.spec.param,
            self.schedule,
            self.order,
            self.plan.hot,
            self.dim,
            self.noise.np_dtype,
            window,
            digest,
        )
        try:
            precompute_into(
                assembly.add,
                self.schedule,
                self.order,
                self.plan.hot,
                self.dim,
                self.mechanism,
                self.noise,
                self.factors,
                tile_rows=self.tile_rows,
                progress=progress,
                parts=parts,
            )
            stored, crcs = assembly.finish()
        finally:
            assembly.close()
        windows = CscWindows(stored, window, crcs=crcs)
        self.csc = windows
        self.precompute_seconds = time.perf_counter() - t0
        return windows

    def set_csc(self, csc: CoalescedCSC | CscWindows | StoredCSC | StoredParts) -> None:
        """Use a CSC loaded from the store (it was checksummed there), read from it in
        windows, or committed in it: then read whole, or in windows when
        `csc_window_steps` is set. On several ranks (`shard`), or from a version written
        by several (`StoredParts`), the entries of this rank's slots are read from the
        parts that hold them (`embedding.csc_shards`)."""
        if isinstance(csc, StoredParts | StoredCSC) and (
            self.ranks is not None or isinstance(csc, StoredParts)
        ):
            if csc.steps != self.schedule.steps or csc.dim != self.dim:
                raise StoredStateError(
                    f"table {self.spec.param}: the stored CSC has {csc.steps} steps x "
                    f"({csc.dim},) but this job needs {self.schedule.steps} x ({self.dim},)"
                )
            slot_of = np.empty_like(self.order)
            slot_of[self.order] = np.arange(self.order.size, dtype=slot_of.dtype)
            a, z = self.my_part
            self._drop_csc()
            window = self.csc_window_steps
            if self.ranks is not None and window is not None and isinstance(csc, StoredParts):
                windows = PartWindows.of(csc, a, z, window)  # its own part, stored whole
                if windows is not None:
                    self.csc = windows
                    return
            mine = load_range(csc, slot_of, a, z)
            self.csc = self._part(mine) if self.ranks is not None else mine
            return
        if isinstance(csc, CoalescedCSC):
            dim = csc.values.shape[1:]
        else:
            dim = (csc.stored.dim,) if isinstance(csc, CscWindows) else (csc.dim,)
        if csc.steps != self.schedule.steps or dim != (self.dim,):
            raise StoredStateError(
                f"table {self.spec.param}: the stored CSC has {csc.steps} steps x "
                f"{dim} but this job needs {self.schedule.steps} x ({self.dim},)"
            )
        if csc is self.csc:
            return
        self._drop_csc()
        if isinstance(csc, CoalescedCSC | CscWindows):
            self.csc = csc
        elif self.csc_window_steps is None:
            self.csc = csc.load()
        else:
            self.csc = CscWindows(csc, self.csc_window_steps)

    def csc_committed(self, stored: StoredCSC) -> None:
        """This table's CSC is committed as `stored`: with `csc_window_steps` set, the
        steps from now on read it from the store in windows, and the whole CSC the
        precompute left in memory is let go (the windows are checked against it)."""
        if self.csc_window_steps is None or not isinstance(self.csc, CoalescedCSC):
            return
        windows = CscWindows(stored, self.csc_window_steps, like=self.csc)
        self.csc = windows

    def parts_committed(self, stored: StoredParts) -> None:
        """On several ranks, this table's CSC is committed in parts as `stored`: with
        `csc_window_steps` set, this rank reads its own part from the store in windows
        from now on and lets go of the part its precompute left in memory (the windows
        are checked against it). A rank of an empty run keeps its empty part."""
        if self.csc_window_steps is None or not isinstance(self.csc, CscPart):
            return
        windows = PartWindows.of(stored, *self.my_part, self.csc_window_steps, like=self.csc)
        if windows is not None:
            self.csc = windows

    def _drop_csc(self) -> None:
        if isinstance(self.csc, CscWindows | PartWindows):
            self.csc.close()
        self.csc = None

    # per step --------------------------------------------------------------------
    def before_read(self, t: int, weight: torch.Tensor) -> None:
        """Apply the pending noise of the rows step t reads (coalesced, lazy)."""
        if self.plan.mode is TableMode.COALESCED:
            if self.csc is None:
                raise RuntimeError(f"table {self.spec.param}: precompute() has not run")
            if t == self.schedule.steps and isinstance(self.csc, CscWindows):
                for rows, vals in self.csc.tail_pieces():  # one window's worth at a time
                    self._apply(weight, rows, vals)
            elif self.ranks is not None:
                self._apply(weight, *self._gathered(*self.csc.column(t)))
            else:
                self._apply(weight, *self.csc.column(t))
        elif self.lazy is not None:
            lo, hi = int(self.schedule.step_ptr[t]), int(self.schedule.step_ptr[t + 1])
            if hi > lo:
                rows = self.schedule.step_rows[lo:hi]
                upd = self.lazy.updates(
                    rows, self.schedule.step_seq[lo:hi], self.schedule.step_prev[lo:hi], t
                )
                weight.index_add_(0, torch.from_numpy(rows), torch.from_numpy(upd).to(self.dtype))
                self.entries_applied += hi - lo

    def _gathered(self, rows: np.ndarray, vals: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Column t's entries from every rank's part (a collective), sorted by row as the
        one-process column is: a row is in one rank's part only."""
        if self.ranks is None:
            return rows, vals
        return by_row(self.ranks.all_gather_object((rows, vals)))

    @property
    def sharded(self) -> bool:
        """This rank holds only its part of the CSC (`shard`)."""
        return self.ranks is not None

    def my_column(self, t: int) -> tuple[np.ndarray, np.ndarray]:
        """Column t of this rank's part (t = steps: its tails)."""
        if not isinstance(self.csc, CoalescedCSC | PartWindows):
            raise RuntimeError(f"table {self.spec.param}: precompute() has not run")
        return self.csc.column(t)

    def apply_parts(self, weight: torch.Tensor, parts: list[tuple[np.ndarray, np.ndarray]]) -> None:
        """Apply a column gathered from every rank's part (in rank order)."""
        self._apply(weight, *by_row(parts))

    def _apply(self, weight: torch.Tensor, rows: np.ndarray, vals: np.ndarray) -> None:
        if rows.size:
            with one_thread():  # a column is about a batch of rows (one_thread says why)
                weight.index_add_(0, torch.from_numpy(rows), torch.from_numpy(vals))
        self.entries_applied += int(rows.size)

    def online_noise(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows, w rows) of this step's online noise, (H,) and (H, dim), or None."""
        if self.online is None:
            return None
        w = self.online.step()
        return self._online_index, w.view(self.online_rows, self.dim)

    def dense_grad(self, rows: torch.Tensor, vals: torch.Tensor) -> torch.Tensor:
        """The dense path's full (R, dim) gradient sum: clipped rows plus this step's w."""
        out = torch.zeros(self.rows, self.dim, dtype=self.dtype)
        online = self.online_noise()
        if online is not None:
            out[online[0]] = online[1]
        out.index_add_(0, rows, vals.to(self.dtype))
        return out

    def sgd_update(
        self, weight: torch.Tensor, rows: torch.Tensor, vals: torch.Tensor, lr: float, batch: int
    ) -> None:
        """Coalesced / lazy SGD step: the read rows' clipped gradient and the hot rows'
        online noise; every other row's noise waits in its entry."""
        scale = -lr / batch
        if rows.numel():
            with one_thread():  # a batch of rows (one_thread says why)
                weight.index_add_(0, rows, vals.to(self.dtype), alpha=scale)
        online = self.online_noise()
        if online is not None:
            weight.index_add_(0, online[0], online[1], alpha=scale)

    def finish(self, weight: torch.Tensor) -> None:
        """Apply every cold row's tail: the final model then carries all its noise."""
        n = self.schedule.steps
        if self.plan.mode is TableMode.COALESCED:
            self.before_read(n, weight)
        elif self.lazy is not None:
            seq, last = self.schedule.tails()
            rows = np.arange(self.rows, dtype=np.int64)
            upd = self.lazy.updates(rows, seq, last, n)
            weight.index_add_(0, torch.from_numpy(rows), torch.from_numpy(upd).to(self.dtype))

    def history_bytes(self) -> int:
        return self.online.history_bytes() if self.online is not None else 0

    def close(self) -> None:
        if self.online is not None:
            self.online.close()
        if isinstance(self.csc, PartWindows) and self.csc.windows is not None:
            self.csc.close()
            log.info(
                "table %s: CSC part [%d, %d) read in %d windows of %d steps, at most %d "
                "bytes resident",
                self.spec.param,
                self.csc.start,
                self.csc.stop,
                self.csc.windows.windows_read,
                self.csc.windows.window_steps,
                self.csc.windows.peak_resident_bytes,
            )
        if isinstance(self.csc, CscWindows):
            self.csc.close()
            log.info(
                "table %s: CSC of %d bytes read in %d windows of %d steps, at most %d bytes "
                "resident",
                self.spec.param,
                self.csc.nbytes,
                self.csc.windows_read,
                self.csc.window_steps,
                self.csc.peak_resident_bytes,
            )

    # state -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "kind": "TableEngine",
            "schema_version": 1,
            "param": self.spec.param,
            "plan": self.plan.to_record(),
            "online": self.online.state_dict() if self.online is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_state(state, "TableEngine", 1)
        plan = TablePlan.from_record(state["plan"])
        if (plan.mode, plan.hot) != (self.plan.mode, self.plan.hot):
            raise StoredStateError(
                f"table {self.spec.param}: stored plan {plan.mode.value} with {plan.hot} hot "
                f"rows, this engine has {self.plan.mode.value} with {self.plan.hot}"
            )
        if self.online is not None:
            self.online.load_state_dict(state["online"])


class OffsetTiles:
    """`TileParts` of a run of a table's tiles: the run's tile i is the table's tile
    `first` + i (a rank's precompute numbers its own tiles from 0)."""

    def __init__(self, parts: TileParts, first: int) -> None:
        self.parts = parts
        self.first = first

    def load(self, index: int, slots: np.ndarray, like: TileLayout) -> TileEntries | None:
        return self.parts.load(self.first + index, slots, like)

    def save(self, index: int, slots: np.ndarray, entries: TileEntries) -> None:
        self.parts.save(self.first + index, slots, entries)
