"""Beyond one process: the noise history sharded across ranks of torch.distributed.

Data-parallel training. Each rank clips the per-sample gradients of its part of the
step's batch; the partial sums are gathered and added in rank order (the same
association on every rank, so parameters stay identical across ranks). The parameter
dimension's noise blocks are split across ranks: a rank keeps (b-1)/world of the
history, draws only its slice of fresh noise (I1) and computes its slice of w_t; one
all-gather per step gives every rank the whole w_t. With the fixed-order GEMV kernel
the noise is bit-identical to a single process's for any world size.

Embedding tables under lazy (b = 1) or coalesced noise are data-parallel too: every
rank holds the whole table, and the per-row clipped gradients of its examples are
gathered and added in rank order (`sum_rows_in_rank_order`). Each lazy draw is split by
rank (`embedding.lazy.RowShares`, `gather_rows`); a coalesced table's cold slots are
split by whole precompute tiles, each rank precomputes and holds the CSC of its own
and the ranks gather each step's column (`embedding.csc_shards`). Dense table noise
does not shard yet and is refused on more than one rank.

The process group is torch.distributed's own (gloo on CPU, NCCL on GPU), initialised
from torchrun's environment (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`). A
group this module initialised is destroyed when the process ends (`end_process_group`,
registered with `atexit`; the CLI, which leaves by `os._exit`, calls it itself), on
every way out, a refusal included: a live gloo group's threads torn down with the
interpreter can abort a rank (SIGABRT) whose peer left first. A group the caller
initialised is the caller's to destroy.
"""

from __future__ import annotations

import atexit
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from cocoon_ckpt.dp.noise import BLOCK
from cocoon_ckpt.embedding.config import EmbeddingConfig, TableMode
from cocoon_ckpt.embedding.one_thread import one_thread
from cocoon_ckpt.errors import ConfigError
from cocoon_ckpt.train.rank_failure import packed, unpacked

__all__ = [
    "DistContext",
    "check_distributed",
    "coalesced_on_ranks",
    "end_process_group",
    "lazy_on_ranks",
    "shard_bounds",
]

T = TypeVar("T")


#: Whether `DistContext.from_env` initialised the running process group (then it is
#: ours to destroy).
_STARTED = threading.Event()


def end_process_group() -> None:
    """Destroy the process group if `DistContext.from_env` initialised it and it is
    still up; else nothing. Local (no collective): every rank calls it as it leaves, so
    each tears its own gloo threads down before the interpreter does."""
    if not _STARTED.is_set():
        return
    _STARTED.clear()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def shard_bounds(dim: int, world: int) -> list[tuple[int, int]]:
    """[start, stop) of each rank's noise coordinates: whole 65,536-coordinate blocks
    when there are at least as many blocks as ranks (no block is drawn twice), else
    an even split of the coordinates."""
    if world < 1:
        raise ValueError(f"world={world} must be >= 1")
    blocks = -(-dim // BLOCK)
    if blocks >= world:
        cuts = [min(dim, (blocks * r // world) * BLOCK) for r in range(world + 1)]
    else:
        cuts = [dim * r // world for r in range(world + 1)]
    return list(zip(cuts[:-1], cuts[1:], strict=True))


def lazy_on_ranks(embedding: EmbeddingConfig, bands: int) -> bool:
    """Whether every table of `embedding` takes lazy noise (the path that shards):
    b = 1, `final_model`, and mode lazy or auto (`EmbeddingNoise` chooses lazy then)."""
    return (
        bands == 1
        and embedding.coalescing_allowed
        and embedding.mode in (TableMode.LAZY, TableMode.AUTO)
    )


def coalesced_on_ranks(embedding: EmbeddingConfig, bands: int) -> bool:
    """Whether every table of `embedding` may take coalesced noise (the other path
    that shards): `final_model`, b > 1 or mode coalesced, and mode coalesced or auto."""
    return (
        embedding.coalescing_allowed
        and embedding.mode in (TableMode.COALESCED, TableMode.AUTO)
        and not lazy_on_ranks(embedding, bands)
    )


def check_distributed(embedding: EmbeddingConfig | None, world: int, bands: int) -> None:
    """Refuse what a job of `world` ranks cannot run, before anything is written.

    Every mechanism shards (BandMF's ring and BLT's buffers alike: both a `RingHistory`
    of the shard's columns, the fresh noise a pure function of (key, t, block)), and so
    does the embedding tables' lazy (b = 1) and coalesced noise; their dense noise does
    not. A coalesced plan must be the same on every rank, so its hot threshold is given,
    not chosen by a timed profile on each; each rank holds its part of the CSC only (in
    windows once committed, where `csc_window_steps` is set).

    Args:
        embedding: the job's `EmbeddingConfig`, or None.
        world: the number of ranks.
        bands: the job's b (`DPConfig.bands`).

    Raises:
        ConfigError: dense table noise (mode dense, or not `final_model`) with more than
            one rank; coalesced noise on several ranks without `hot_threshold`.
    """
    if world <= 1 or embedding is None or lazy_on_ranks(embedding, bands):
        return
    if not coalesced_on_ranks(embedding, bands):
        raise ConfigError(
            f"embedding noise with torch.distributed (WORLD_SIZE={world}) is supported for "
            f"lazy and coalesced noise only (threat_model='final_model', mode lazy, "
            f"coalesced or auto), not mode={embedding.mode.value!r} with bands={bands} and "
            f"threat_model={embedding.threat_model!r}: run the embedding job in one "
            "process, use --embedding coalesced --threat-model final_model (or --embedding "
            "lazy --bands 1), or drop EmbeddingConfig (--embedding)"
        )
    if embedding.hot_threshold is None:
        raise ConfigError(
            f"EmbeddingConfig.hot_threshold=None with torch.distributed (WORLD_SIZE={world}): "
            "coalesced noise on several ranks needs the threshold given (a timed profile "
            "could choose another on each rank); give hot_threshold (--hot-threshold)"
        )


@dataclass(frozen=True, slots=True)
class DistContext:
    """This process's place in the job: rank r of world ranks."""

    rank: int
    world: int

    @property
    def is_coordinator(self) -> bool:
        """Rank 0 holds the lease, writes the manifest and prints."""
        return self.rank == 0

    @classmethod
    def from_env(cls) -> DistContext | None:
        """The running process group, or one started from torchrun's environment; None
        in a single process."""
        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size())
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return None
        if not dist.is_available():
            raise RuntimeError(f"WORLD_SIZE={world} but this torch build has no torch.distributed")
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            # NCCL's object collectives (the start's agreements) stage on the current
            # device: without this every rank of a host would use cuda:0
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=backend)
        if not _STARTED.is_set():
            _STARTED.set()
            atexit.register(end_process_group)
        return cls(dist.get_rank(), dist.get_world_size())

    def bounds(self, dim: int) -> tuple[int, int]:
        return shard_bounds(dim, self.world)[self.rank]

    def my_examples(self, idx: np.ndarray) -> np.ndarray:
        """This rank's contiguous part of a step's sorted example indices."""
        return np.array_split(idx, self.world)[self.rank]

    def sum_in_rank_order(self, partial: torch.Tensor) -> torch.Tensor:
        """sum_r partial_r, added in rank order on every rank (one association)."""
        parts = [torch.empty_like(partial) for _ in range(self.world)]
        dist.all_gather(parts, partial.contiguous())
        out = parts[0].clone()
        for p in parts[1:]:
            out += p
        return out

    def gather_rows(self, part: np.ndarray, counts: Sequence[int]) -> np.ndarray:
        """(sum(counts), dim): every rank's `part` ((counts[rank], dim)) in rank order,
        on every rank (one all-gather, padded to the largest share)."""
        width = max(counts)
        buf = torch.zeros((width, *part.shape[1:]), dtype=torch.from_numpy(part[:0]).dtype)
        buf[: part.shape[0]] = torch.from_numpy(part)
        parts = [torch.empty_like(buf) for _ in range(self.world)]
        dist.all_gather(parts, buf)
        return torch.cat([p[:c] for p, c in zip(parts, counts, strict=True)]).numpy()

    def sum_rows_in_rank_order(
        self, grads: Sequence[tuple[torch.Tensor, torch.Tensor]]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each table's (unique rows (k,), summed clipped row gradients (k, dim)) over
        every rank's examples, from each rank's own: the ranks' sums of a row added in
        rank order (one association on every rank, so the tables stay identical)."""
        mine = [(rows.cpu().numpy(), vals.cpu().numpy()) for rows, vals in grads]
        gathered = self.all_gather_object(mine)
        out = []
        for i, (rows, vals) in enumerate(grads):
            every = torch.from_numpy(np.concatenate([g[i][0] for g in gathered]))
            sums = torch.from_numpy(np.concatenate([g[i][1] for g in gathered]))
            with one_thread():  # a batch of rows (one_thread says why)
                uniq, inv = torch.unique(every, return_inverse=True)
                acc = torch.zeros(uniq.numel(), *sums.shape[1:], dtype=sums.dtype)
                acc.index_add_(0, inv, sums)  # in index order: rank order
            out.append((uniq.to(rows.device), acc.to(vals.device)))
        return out

    def gather_noise(self, shard: torch.Tensor, dim: int) -> torch.Tensor:
        """The whole w_t from every rank's slice (one all-gather, padded to the widest)."""
        bounds = shard_bounds(dim, self.world)
        width = max(z - a for a, z in bounds)
        buf = torch.zeros(width, dtype=shard.dtype)
        buf[: shard.numel()] = shard
        parts = [torch.empty_like(buf) for _ in range(self.world)]
        dist.all_gather(parts, buf)
        return torch.cat([p[: z - a] for p, (a, z) in zip(parts, bounds, strict=True)])

    def all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""
        box = [obj if self.is_coordinator else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def agree(self, failure: BaseException | None) -> None:
        """Every rank's checks done (`failure`: what this rank's raised, or None): raise,
        on every rank, the failure of the lowest rank that had one, as that rank raised
        it, so no rank goes on while another stops, and all exit alike.

        Raises:
            BaseException: the lowest failing rank's failure (this rank's own, traceback
                included, where it is the lowest).
        """
        failures = self.all_gather_object(None if failure is None else packed(failure))
        first = next((r for r, f in enumerate(failures) if f is not None), None)
        if first is None:
            return
        if first == self.rank and failure is not None:
            raise failure
        raise unpacked(failures[first])

    def gather_checked(self, compute: Callable[[], T]) -> list[T]:
        """`compute()` run on every rank, every rank's result on every rank (in rank
        order), or, where any rank's raised, the failure of the lowest such rank raised on
        every rank as `agree` raises it: the ranks compare what they gathered without a
        second collective, and none goes on while another stops.

        Raises:
            BaseException: the lowest failing rank's failure.
        """
        failure: BaseException | None = None
        value: T | None = None
        try:
            value = compute()
        except BaseException as exc:
            failure = exc
        gathered = self.all_gather_object(
            ("ok", value) if failure is None else ("error", packed(failure))
        )
        first = next((r for r, (status, _) in enumerate(gathered) if status == "error"), None)
        if first is not None:
            if first == self.rank and failure is not None:
                raise failure
            raise unpacked(gathered[first][1])
        return [v for _, v in gathered]

    def from_coordinator(self, compute: Callable[[], T]) -> T:
        """`compute()` run on rank 0 alone, its result (or its failure, raised as rank 0
        raised it) on every rank.

        Raises:
            BaseException: whatever `compute` raised on rank 0.
        """
        if not self.is_coordinator:
            status, payload = self.broadcast_object(None)
            if status == "error":
                raise unpacked(payload)
            return payload  # type: ignore[no-any-return]
        try:
            value = compute()
        except BaseException as exc:
            self.broadcast_object(("error", packed(exc)))
            raise
        self.broadcast_object(("ok", value))
        return value

    def barrier(self) -> None:
        dist.barrier()
