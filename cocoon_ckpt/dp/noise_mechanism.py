"""The noise contract: what a streaming correlated-noise mechanism offers the trainer,
the checkpoint and the audit, whichever strategy C it runs.

Two implement it: `cocoon_ckpt.dp.bandmf_noise.BandMFNoise` (b-1 ring slots of past
outputs) and `cocoon_ckpt.dp.blt.noise.BLTNoise` (d buffers). Both keep their state as
rows of one `RingHistory`, so the tiers hold either, and both label each row with a
step, so a checkpoint stores and an audit regenerates either the same way. Only the
factory (`cocoon_ckpt.dp.noise_factory`) names the classes; everything else reads this
protocol. `cocoon_ckpt.dp.testing.noise_tests` is its conformance suite.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import numpy as np
    import torch

    from cocoon_ckpt.dp.noise import KeyedNoise
    from cocoon_ckpt.dp.ring import RingHistory

__all__ = ["NoiseMechanism", "replay_rows"]


@runtime_checkable
class NoiseMechanism(Protocol):
    """w = C^-1 z for the coordinate range [start, stop) of an m-long vector, one step
    at a time, z the keyed fresh noise (`KeyedNoise`, I1).

    Guarantee: `step()` at step t returns w_t[start:stop] of the dense solve
    `materialize(n)` (C W = Z) up to rounding, and bit for bit the same values whatever
    holds `state_rows` (any tier, I2) and however [0, m) is split into shards; an
    instance built alike that loads `state_dict()` returns the same next steps bit for
    bit (I3). Each row of `state_rows` holds values that depend on the key and the steps
    up to its label in `row_steps()` only, so an audit can regenerate any stored row from
    the key at a few coordinates.

    The state dict carries `kind`, `schema_version`, `t`, `start`, `stop`, `dtype`,
    `ring` (the live `state_rows`, by reference: copy what you keep before the next
    `step()`), `slot_steps` (`row_steps()`) and `persistent_rows` (as the attribute).
    `load_state_dict` refuses another kind's state and any `ring` not of its rows'
    shape and dtype.
    """

    t: int
    """The next step (steps taken)."""
    start: int
    """First coordinate of this shard."""
    stop: int
    """End of this shard (exclusive)."""
    dtype: torch.dtype
    """float32 or float64: the dtype of w and of the rows."""
    fresh_noise: KeyedNoise
    """z: the keyed fresh noise over the whole dimension."""
    persistent_rows: bool
    """True: a row keeps its values until its slot is written again (BandMF's ring: a
    checkpoint borrows rows its parent holds, and slot t mod (b-1) is the head); False:
    every step rewrites every row (a BLT's buffers: each version stores all of them)."""

    @property
    def width(self) -> int:
        """stop - start."""
        ...

    @property
    def state_rows(self) -> RingHistory:
        """The (rows, width) noise state, where the tiers hold it: BandMF's b-1 ring
        slots, a BLT's d buffers; 0 rows for DP-SGD."""
        ...

    def row_steps(self) -> list[int | None]:
        """Each row's step label, in row order (None: never written): the step whose w
        a ring slot holds, or the step after which a BLT buffer was taken (t - 1)."""
        ...

    def step(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """w_t[start:stop], (width,) in `dtype`; advances t. Written into `out` when
        given (a contiguous (width,) CPU tensor of `dtype`, kept by the caller from step
        to step, returned); else a fresh tensor."""
        ...

    def materialize(self, n: int) -> torch.Tensor:
        """The dense reference w_0..w_{n-1}, (n, width), by a triangular solve; leaves
        this instance's state as it was."""
        ...

    def regenerate_rows(
        self, coords: np.ndarray, rows: Iterable[tuple[int, int]]
    ) -> dict[tuple[int, int], np.ndarray]:
        """What the audit compares stored rows with: each (slot, label) of `rows` as the
        row held it once step `label` was taken, at the coordinates `coords` of the
        whole dimension (not only this shard's), {(slot, label): (len(coords),)},
        replayed from step 0 on those coordinates alone from the key (the recursion is
        coordinate-wise and the GEMV has one order of rounding, so bit for bit what an
        instance held). Memory is the rows asked for, not the steps replayed. Leaves
        this instance's state as it was."""
        ...

    def history_bytes(self) -> int:
        """Bytes of noise state held (`state_rows.nbytes`)."""
        ...

    def close(self) -> None:
        """Free the rows' storage (stops a far-memory worker). Idempotent."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """The record above, the rows by reference."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load `state` (as `state_dict()` returns it, or a resume reads it).

        Raises:
            StateSchemaError: another kind's state, or another schema version.
            ValueError: another shard, or rows of another shape or dtype.
        """
        ...


def replay_rows(
    rows: Iterable[tuple[int, int]],
    history: RingHistory,
    step: Callable[[int, RingHistory], object],
) -> dict[tuple[int, int], np.ndarray]:
    """The replay every `regenerate_rows` runs: `step(t, history)` for t = 0 up to the
    last label asked for, each (slot, label) of `rows` read from `history` once step
    `label` is taken.

    Raises:
        IndexError: a slot outside the history's rows.
    """
    by_step: dict[int, list[int]] = {}
    for slot, label in rows:
        by_step.setdefault(label, []).append(slot)
    out: dict[tuple[int, int], np.ndarray] = {}
    for t in range(max(by_step, default=-1) + 1):
        step(t, history)
        for slot in by_step.get(t, ()):
            out[(slot, t)] = history.read(slot)
    return out
