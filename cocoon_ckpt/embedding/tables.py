"""All embedding tables of a job: schedules, plans, engines, and their state."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from cocoon_ckpt._state_dict import check_state
from cocoon_ckpt.dp.mechanism import BandMF
from cocoon_ckpt.embedding.config import EmbeddingConfig, TableMode
from cocoon_ckpt.embedding.csc import CoalescedCSC
from cocoon_ckpt.embedding.csc_shards import CscPart, CscRanks, StoredParts
from cocoon_ckpt.embedding.csc_window import StoredCSC
from cocoon_ckpt.embedding.engine import TableEngine, TablePlan
from cocoon_ckpt.embedding.profile import choose_threshold, measure_unit_costs
from cocoon_ckpt.embedding.schedule import AccessSchedule, table_schedule
from cocoon_ckpt.embedding.sparse import check_tables
from cocoon_ckpt.embedding.stored_tiles import StoredTiles, TileWriter, drop_tile_parts
from cocoon_ckpt.errors import ConfigError, JobError, StoredStateError
from cocoon_ckpt.keys import tile_mac_key
from cocoon_ckpt.layout import emb_name
from cocoon_ckpt.tiers.config import TierConfig
from state import Version

if TYPE_CHECKING:
    from state import Manifest, Store

__all__ = ["EmbeddingNoise"]

log = logging.getLogger(__name__)


def _check_sgd(optimizer: torch.optim.Optimizer, param: str, mode: TableMode) -> None:
    why = None
    if type(optimizer) is not torch.optim.SGD:
        why = f"the optimizer is {type(optimizer).__name__}"
    else:
        for g in optimizer.param_groups:
            for k in ("momentum", "weight_decay"):
                if g.get(k, 0):
                    why = f"the SGD optimizer has {k}={g[k]}"
            if g.get("maximize"):
                why = "the SGD optimizer maximizes"
    if why:
        raise ConfigError(
            f"embedding table {param!r} uses mode={mode.value!r}, which is exact only for "
            f"plain SGD (a row's pending noise is applied late), but {why}. Use "
            "optimizer='sgd' without momentum or weight decay, or mode='dense'"
        )


class EmbeddingNoise:
    """The noise of every embedding table of a job.

    Args:
        config: which tables and which path.
        model: the model holding the tables.
        optimizer: its optimizer (checked: coalesced and lazy tables need plain SGD).
        data: the job's data tensors (ids in the columns the specs name).
        batches: batch(0), ..., batch(n-1) of the seeded sampler.
        mechanism: the BandMF strategy.
        key: the job's noise key.
        std: sigma * clip.
        batch_size: B (the noise and gradient are divided by it).
        plans: per table parameter, the plan a resumed job recorded (None: choose now).
        tiers: where each table's online history lives (None: the host).
    """

    def __init__(
        self,
        config: EmbeddingConfig,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        data: Sequence[torch.Tensor],
        batches: Sequence[np.ndarray],
        mechanism: BandMF,
        key: bytes,
        std: float,
        batch_size: int,
        plans: dict[str, TablePlan] | None = None,
        tiers: TierConfig | None = None,
    ) -> None:
        check_tables(model, config.tables, data)
        self.config = config
        self._ranks: CscRanks | None = None
        self._tile_mac_key = tile_mac_key(key)  # the kept precompute tiles' MACs
        self.optimizer = optimizer
        self.batch_size = batch_size
        self.steps = len(batches)
        params = dict(model.named_parameters())
        self.params = [params[s.param] for s in config.tables]
        self._groups = [self._group_of(p) for p in self.params]
        self.engines: list[TableEngine] = []
        for spec, p, group in zip(config.tables, self.params, self._groups, strict=True):
            lrs = np.asarray(
                config.lr_schedule
                if config.lr_schedule is not None
                else [float(group["lr"])] * self.steps,
                dtype=np.float64,
            )
            if lrs.shape != (self.steps,):
                raise ConfigError(
                    f"EmbeddingConfig.lr_schedule has {lrs.size} rates; the job has "
                    f"{self.steps} steps"
                )
            rows, dim = p.shape
            sched = table_schedule(
                data[spec.data_index][:, spec.column].numpy(), batches, int(rows)
            )
            plan = (plans or {}).get(spec.param) or self._choose(sched, mechanism, int(dim), p)
            if plan.mode in (TableMode.COALESCED, TableMode.LAZY):
                _check_sgd(optimizer, spec.param, plan.mode)
            self.engines.append(
                TableEngine(
                    spec,
                    int(rows),
                    int(dim),
                    mechanism,
                    key,
                    std,
                    p.dtype,
                    sched,
                    lrs / batch_size,
                    plan,
                    config.tile_rows,
                    tiers,
                    csc_window_steps=config.csc_window_steps,
                )
            )

    def _group_of(self, p: torch.Tensor) -> dict[str, Any]:
        for g in self.optimizer.param_groups:
            if any(q is p for q in g["params"]):
                return g
        raise JobError("an embedding table is not among the optimizer's parameters")

    def _choose(
        self, sched: AccessSchedule, mechanism: BandMF, dim: int, p: torch.Tensor
    ) -> TablePlan:
        cfg = self.config
        mode = cfg.mode
        if not cfg.coalescing_allowed or mode is TableMode.DENSE:
            return TablePlan(TableMode.DENSE, sched.rows, None, {})
        if mode is TableMode.LAZY or (mode is TableMode.AUTO and mechanism.bands == 1):
            return TablePlan(TableMode.LAZY, 0, None, {})
        counts = sched.counts
        if cfg.hot_threshold is not None:
            h: int | None = cfg.hot_threshold
            rec: dict[str, Any] = {"threshold_from": "user"}
        else:
            costs = measure_unit_costs(mechanism, dim, p.dtype)
            h, rec = choose_threshold(counts, sched.steps, dim, costs)
            rec["threshold_from"] = "profile"
            if h is None and mode is TableMode.AUTO:
                return TablePlan(TableMode.DENSE, sched.rows, None, rec)
            if h is None:
                h = int(rec["best_threshold"])
        hot = int(np.count_nonzero(counts > h))
        return TablePlan(TableMode.COALESCED, hot, h, rec)

    # the run ---------------------------------------------------------------------
    def prepare(
        self,
        progress: Callable[[int], None] | None = None,
        *,
        store: Store | None = None,
        job_fingerprint: str | None = None,
    ) -> float:
        """Precompute every coalesced table that has no CSC yet; returns seconds.

        Args:
            progress: called with the slots finished after each tile.
            store: keep each finished tile in this store (its writer lease held; on
                several ranks, rank 0's) and resume from the tiles a stopped precompute
                kept there (`embedding.stored_tiles`); None: in memory only. On several
                ranks every rank passes the store or none does (a collective).
            job_fingerprint: the job's fingerprint, part of the tiles' digest.
        """
        t0 = time.perf_counter()
        kept: list[StoredTiles] = []
        rank = self._rank_folder(store)
        # one writer for every table: the last tiles of one are written while the next
        # table's compute (tables of a single tile would otherwise wait on each write)
        with TileWriter() if store is not None else contextlib.nullcontext() as writer:
            for e in self.engines:
                if e.needs_precompute:
                    parts, digest = None, None
                    if store is not None and (e.ranks is None or rank is not None):
                        digest = e.tile_digest(job_fingerprint)
                        parts = StoredTiles(
                            store,
                            e.spec.param,
                            digest,
                            writer,
                            mac_key=self._tile_mac_key,
                            rank=rank if e.ranks is not None else None,
                        )
                        kept.append(parts)
                    if store is not None and e.csc_window_steps is not None and not e.sharded:
                        e.precompute_to_store(store, progress, parts, digest)  # never whole
                    else:  # on several ranks: its part, in windows once committed
                        e.precompute(progress, parts)
        for parts in kept:
            log.info(
                "table %s: precompute tiles loaded from the store: %d, computed: %d",
                parts.param,
                parts.loaded,
                parts.computed,
            )
        return time.perf_counter() - t0

    def _rank_folder(self, store: Store | None) -> tuple[int, int] | None:
        """On several ranks: (rank 0's lease generation, this rank), the folder this
        rank keeps its tiles in (`StoredTiles`), sent by rank 0 in one all-gather where
        some sharded table still needs its precompute; None in one process, without a
        store or without rank 0's lease (then the tiles are not kept)."""
        ranks = self._ranks
        if ranks is None or not any(e.sharded and e.needs_precompute for e in self.engines):
            return None
        lease = store.lease if store is not None else None
        gen = ranks.all_gather_object(lease.generation if lease is not None else None)[0]
        if store is None or gen is None:
            return None
        return (int(gen), ranks.rank)

    def drop_tile_parts(self, store: Store, manifest: Manifest | None) -> bool:
        """Delete the precompute's tile parts once `manifest` (committed) holds every
        coalesced table's CSC; whether they are gone (`stored_tiles.drop_tile_parts`).
        The CSCs the precompute left in memory are then read from the store in windows
        (`csc_committed`), where the config asks for it."""
        coalesced = [e.spec.param for e in self.engines if e.plan.mode is TableMode.COALESCED]
        self.csc_committed(store, manifest)
        return drop_tile_parts(store, manifest, coalesced)

    def csc_committed(self, store: Store, manifest: Manifest | None) -> None:
        """With `csc_window_steps` set, each coalesced table whose CSC `manifest`
        (committed) holds reads it from the store in windows from now on, and lets go of
        the whole CSC its precompute computed; on several ranks (every rank calls it),
        each its own part."""
        if manifest is None or self.config.csc_window_steps is None:
            return
        version = Version(store, manifest)
        for e in self.engines:
            if e.sharded and isinstance(e.csc, CscPart):  # several ranks: its own part
                parts = StoredParts.of_manifest(
                    version, e.spec.param, e.part_bounds, e.schedule.steps, e.dim
                )
                if parts is not None:
                    e.parts_committed(parts)
                continue
            if isinstance(e.csc, CoalescedCSC) and emb_name(e.spec.param, "csc/values") in (
                manifest.arrays
            ):
                e.csc_committed(StoredCSC.of_version(version, e.spec.param))

    def shard(self, ranks: CscRanks) -> None:
        """Each coalesced table's CSC precomputed and held by part, one per rank
        (`embedding.csc_shards`), read in windows once committed where
        `csc_window_steps` is set; a no-op on one rank."""
        for i, e in enumerate(self.engines):
            e.shard(ranks, offset=i)
        self._ranks = ranks if any(e.sharded for e in self.engines) else None

    @property
    def prepared(self) -> bool:
        return not any(e.needs_precompute for e in self.engines)

    def before_step(self, t: int) -> None:
        """Apply the pending noise of every row step t reads."""
        if not self.prepared:
            self.prepare()
        with torch.no_grad():
            self._gathered_columns(t)
            for e, p in zip(self.engines, self.params, strict=True):
                if not e.sharded:
                    e.before_read(t, p.data)

    def _gathered_columns(self, t: int) -> None:
        """On several ranks: column t of every sharded table, from every rank's part,
        in one all-gather for all tables (a collective per table cost a scheduling
        wait each on a loaded machine), applied as each one process's column."""
        if self._ranks is None:
            return
        mine = [e.my_column(t) if e.sharded else None for e in self.engines]
        every = self._ranks.all_gather_object(mine)
        for i, (e, p) in enumerate(zip(self.engines, self.params, strict=True)):
            if e.sharded:
                e.apply_parts(p.data, [rank[i] for rank in every])

    def set_grads(self, grads: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Dense tables: .grad = (clipped rows + w_t) / B, stepped by the optimizer."""
        for e, p, (rows, vals) in zip(self.engines, self.params, grads, strict=True):
            if e.plan.mode is TableMode.DENSE:
                p.grad = e.dense_grad(rows, vals).div_(self.batch_size)
            else:
                p.grad = None

    def sgd_updates(self, t: int, grads: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Coalesced / lazy tables: the sparse SGD step at the precomputed rate."""
        with torch.no_grad():
            for e, p, g, (rows, vals) in zip(
                self.engines, self.params, self._groups, grads, strict=True
            ):
                if e.plan.mode is TableMode.DENSE:
                    continue
                lr = float(g["lr"])
                want = float(e.factors[t] * self.batch_size)
                if abs(lr - want) > 1e-12 * max(abs(want), 1.0):
                    raise ValueError(
                        f"step {t}: table {e.spec.param!r} is at learning rate {lr}, but its "
                        f"noise entries were precomputed for {want}; give the schedule as "
                        "EmbeddingConfig.lr_schedule"
                    )
                e.sgd_update(p.data, rows, vals, lr, self.batch_size)

    def finish(self) -> None:
        """After the last step: every cold row's tail."""
        with torch.no_grad():
            self._gathered_columns(self.steps)  # the sharded tables' tails
            for e, p in zip(self.engines, self.params, strict=True):
                if not e.sharded:
                    e.finish(p.data)

    def history_bytes(self) -> int:
        return sum(e.history_bytes() for e in self.engines)

    def close(self) -> None:
        for e in self.engines:
            e.close()

    def plans(self) -> dict[str, TablePlan]:
        return {e.spec.param: e.plan for e in self.engines}

    # state -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "kind": "EmbeddingNoise",
            "schema_version": 1,
            "threat_model": self.config.threat_model,
            "tables": [e.state_dict() for e in self.engines],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_state(state, "EmbeddingNoise", 1)
        if [t["param"] for t in state["tables"]] != [e.spec.param for e in self.engines]:
            raise StoredStateError(
                f"stored embedding tables {[t['param'] for t in state['tables']]} differ from "
                f"this job's {[e.spec.param for e in self.engines]}"
            )
        for e, st in zip(self.engines, state["tables"], strict=True):
            e.load_state_dict(st)
