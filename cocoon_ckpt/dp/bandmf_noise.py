"""BandMF's streaming noise: w = C^-1 z for one coordinate range, one step at a time.

`BandMFNoise` runs `cocoon_ckpt.dp.noise.bandmf_step` on the keyed fresh noise
(`KeyedNoise`, I1) and keeps the last b-1 outputs in a `RingHistory` (the tiers can hold
it), with the crash points of `cocoon_ckpt.dp.noise`. It is one `NoiseMechanism`; a BLT's
is `cocoon_ckpt.dp.blt.noise.BLTNoise`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

import numpy as np
import torch

from cocoon_ckpt._state_dict import check_state
from cocoon_ckpt.dp.gemv import COMPILED_MIN_ELEMENTS
from cocoon_ckpt.dp.mechanism import BandMF
from cocoon_ckpt.dp.noise import (
    AFTER_FRESH,
    AFTER_GEMV,
    BEFORE_FRESH,
    BLOCK,
    NoiseRng,
    bandmf_step,
    bandmf_step_in_slot,
    dense_solve,
    keyed_shard,
)
from cocoon_ckpt.dp.noise_mechanism import replay_rows
from cocoon_ckpt.dp.ring import HostRing, InPlaceRing, RingHistory, load_ring_into, shard_ring
from cocoon_ckpt.errors import StoredStateError
from state import hooks

__all__ = ["BandMFNoise"]


def _after_gemv(t: int) -> None:
    hooks.point(AFTER_GEMV, step=t)


class BandMFNoise:
    """BandMF's w_t = C^-1 z for one coordinate range [start, stop), one step at a time:
    a `NoiseMechanism` whose rows are the ring of the last b-1 outputs (slot t mod
    (b-1) holds w_t, kept until step t + b - 1 overwrites it).

    State passed in and out explicitly: `state_dict()` holds the next step, the ring
    layout and (as arrays) the ring slots. `materialize(n)` gives the dense reference.

    Args:
        mechanism: the BandMF strategy.
        dim: m, the full model dimension (the key's coordinate space).
        key: 32 secret bytes.
        noise_std: sigma * clip.
        dtype: float32 or float64.
        start: first coordinate of the range this instance serves (a shard); 0 by default.
        stop: end of that range (exclusive); None: the whole dimension.
        history: where the ring lives, any `RingHistory` (`cocoon_ckpt.tiers` places it
            over device, host and far memory); a `HostRing` by default.
        rng: the fresh noise's generator (`NoiseRng`).
    """

    persistent_rows = True
    """A ring slot keeps w_t until step t + b - 1 writes it again."""

    slot_min_width = 1 << 20
    """The width from which a step with `out` is computed in its ring slot (`step`):
    below it, the two kept (width,) buffers it saves hold at most 8 MiB of float32."""

    slot_fused_min_elements = COMPILED_MIN_ELEMENTS
    """The ring elements from which a step in the ring slot with the default generator
    is one fused compiled pass over the whole width (`bandmf_step_in_slot`, fused: no
    scratch, one parallel launch); below, numba's start-up would cost more than the
    step, and the step keeps a scratch of one part (`slot_part_width`)."""

    slot_part_width = 1 << 25
    """The most coordinates a step in the ring slot computes at once where it is not
    fused (the secure generator, or a ring under `slot_fused_min_elements`): the width
    is cut in equal parts of whole noise blocks no wider, one after the other, and the
    kept scratch is one part (109 MiB of float32 at 85.9M parameters, 3 parts). Each
    part is a parallel launch of the GEMV at least, 5-8 ms on this loaded 2-core
    machine (`cocoon_ckpt.dp._slot_kernel`): with the secure generator at 85M
    coordinates (load 1.5) a step took 850 ms in parts of 2^25 and 1,105 ms in parts of
    2^22 (a 16 MiB scratch)."""

    def __init__(
        self,
        mechanism: BandMF,
        dim: int,
        key: bytes,
        noise_std: float,
        dtype: str | torch.dtype = "float32",
        *,
        start: int = 0,
        stop: int | None = None,
        history: RingHistory | None = None,
        rng: NoiseRng | str = NoiseRng.DEFAULT,
    ) -> None:
        self.mechanism = mechanism
        self.fresh_noise, self.start, self.stop = keyed_shard(
            key, dim, noise_std, dtype, rng, start, stop
        )
        self.dtype = self.fresh_noise.dtype
        self.t = 0
        self.history: RingHistory = shard_ring(
            history,
            mechanism.bands - 1,
            self.stop - self.start,
            self.fresh_noise.np_dtype.name,
            "history is",
        )
        self.slot_steps: list[int | None] = [None] * self.history.slots
        #: the GEMV's h_t, kept from step to step (made on the first step that needs it)
        self._h: np.ndarray | None = None
        #: a part's h_t of a step in the ring's slot not fused (`slot_part_width`), kept
        #: likewise
        self._chunk_h: np.ndarray | None = None

    @property
    def width(self) -> int:
        return self.stop - self.start

    @property
    def ring(self) -> torch.Tensor:
        """A copy of the ring, (b-1, width), gathered from the tiers."""
        return torch.from_numpy(self.history.gather())

    @property
    def state_rows(self) -> RingHistory:
        """The ring, (b-1, width), where the tiers hold it."""
        return self.history

    def row_steps(self) -> list[int | None]:
        """The step whose w each ring slot holds (None: not written yet)."""
        return list(self.slot_steps)

    def history_bytes(self) -> int:
        return self.history.nbytes

    def close(self) -> None:
        """Free the history's tiers (stops a far-memory worker)."""
        self.history.close()

    def step(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """Produce w_t for the current t, push it into the ring, advance t.

        With `out` given, from `slot_min_width` coordinates on, where the ring is one host
        array (`InPlaceRing`: a `HostRing`, or tiers with every column on one host
        tier) and w_t is the ring's row (b >= 2, s_t = 1), w_t is computed in its ring
        slot itself (`bandmf_step_in_slot`, the same bits): the caller's `out` and the
        kept h (328 MiB each at 85.9M parameters) are then never touched; with the
        default generator the step is one fused pass that keeps no scratch
        (`slot_fused_min_elements`), else its scratch is one part of the width
        (`slot_part_width`). A
        snapshot's lent row of that slot is copied out or finished first (the ring's
        write guards); the crash points fire before any byte of the slot changes.

        Args:
            out: a contiguous (width,) CPU tensor of `dtype` that w_t is written into
                (the caller's, kept from step to step: no fresh pages a step), unless
                w_t is computed in its ring slot; None: a fresh tensor.

        Returns:
            w_t[start:stop], shape (width,): `out`; the ring's slot (a view: read it
            before step t + b - 1, never write it) when computed there; or, with no
            `out`, a fresh tensor (never a view of the ring).
        """
        t = self.t
        hooks.point(BEFORE_FRESH, step=t)
        slots = self.mechanism.bands - 1
        rows = self._open_slot(t) if out is not None else None
        if rows is not None:
            # the slot is w_t's buffer: nothing of it is changed before these points
            hooks.point(AFTER_FRESH, step=t)
            _after_gemv(t)
            fused = self._slot_fused()
            w = bandmf_step_in_slot(
                self.mechanism,
                t,
                self.fresh_noise,
                self.start,
                rows,
                scratch=None if fused else self._slot_scratch(),
                chunk=None if fused else self._slot_chunk(),
                fused=fused,
            )
            self.slot_steps[t % slots] = t
            self.t = t + 1
            return w
        z = self.fresh_noise.fresh(t, self.start, self.stop, out)
        hooks.point(AFTER_FRESH, step=t)
        if slots and self._h is None:
            self._h = np.empty(self.width, dtype=self.history.dtype)
        # Each tier computes its columns where they lie, in one order of rounding, into
        # the kept h; z is this step's own buffer, so w_t takes its place
        w = bandmf_step(
            self.mechanism,
            t,
            z,
            self.history,
            after_gemv=_after_gemv,
            in_place=True,
            scratch=self._h,
        )
        if slots:
            self.slot_steps[t % slots] = t
        self.t = t + 1
        return w

    def _slot_chunk(self) -> int:
        """Coordinates a step in the ring slot computes at once (`slot_part_width`)."""
        parts = -(-self.width // self.slot_part_width)
        return max(1, -(-self.width // (parts * BLOCK))) * BLOCK

    def reserve_scratch(self) -> torch.Tensor | None:
        """Make now the scratch a step in the ring slot keeps where it is not fused (one
        part's h_t, `slot_part_width`), so a caller can fault its pages in before the
        first step (`train.warm.fault_in`: on a 25.8M transformer the first touch of a
        103 MB one was ~1.4 s of the first step's GEMV, against 59 ms after); a tensor
        sharing its memory, or None when no step keeps one (not in the slot, or fused)
        or it is made already. Its values are written before they are read, so none
        depends on when it was made."""
        if self._chunk_h is not None or not self._in_slot() or self._slot_fused():
            return None
        return torch.from_numpy(self._slot_scratch())

    def _slot_fused(self) -> bool:
        """Whether a step in the ring slot is one fused pass (`slot_fused_min_elements`)."""
        return (
            self.fresh_noise.rng is NoiseRng.DEFAULT
            and self.history.slots * self.width >= self.slot_fused_min_elements
        )

    def _in_slot(self) -> bool:
        """Whether steps may be computed in their ring slot: b >= 2, from
        `slot_min_width` coordinates on, on a ring that is one host array (a step whose
        s_t != 1 still is not: `_open_slot`)."""
        return (
            self.mechanism.bands > 1
            and self.width >= self.slot_min_width
            and isinstance(self.history, InPlaceRing)
        )

    def _slot_scratch(self) -> np.ndarray:
        """The kept scratch of a step in the ring slot (one part's h_t), made on first use."""
        need = min(self._slot_chunk(), self.width)
        if self._chunk_h is None or len(self._chunk_h) < need:
            self._chunk_h = np.empty(need, dtype=self.history.dtype)
        return self._chunk_h

    def _open_slot(self, t: int) -> np.ndarray | None:
        """The ring as one writable host array with slot t mod (b-1)'s write guards run,
        when step t is computed in that slot (`step`); else None, no guard run."""
        if not self._in_slot() or self.mechanism.noise_scale(t) != 1.0:
            return None
        ring = cast(InPlaceRing, self.history)  # `_in_slot` checked it
        return ring.open_slot(t % (self.mechanism.bands - 1))

    def materialize(self, n: int) -> torch.Tensor:
        """Dense reference: all of w_0..w_{n-1} by a triangular solve of C W = Z,
        (n, width). Does not touch this instance's state."""
        return dense_solve(self.fresh_noise, self.mechanism.matrix(n), self.start, self.stop)

    def regenerate_rows(
        self, coords: np.ndarray, rows: Iterable[tuple[int, int]]
    ) -> dict[tuple[int, int], np.ndarray]:
        """Ring slots at `coords` once their label's step was taken, replayed from the
        key (`NoiseMechanism.regenerate_rows`): (t mod (b-1), t) is w_t as the ring
        keeps it (C_T^-1 z, before a column-normalized C's scale s_t)."""
        return replay_rows(
            rows,
            HostRing(self.mechanism.bands - 1, len(coords), self.fresh_noise.np_dtype),
            lambda t, ring: bandmf_step(
                self.mechanism, t, self.fresh_noise.fresh_at(t, coords), ring
            ),
        )

    # state -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Small record plus the live ring, by reference (the `RingHistory`): a
        checkpoint reads only the slots it stores (`history.read`), so taking it never
        gathers the whole ring; copy what you keep before the next `step()`."""
        return {
            "kind": "BandMFNoise",
            "schema_version": 2,
            "t": self.t,
            "start": self.start,
            "stop": self.stop,
            "dtype": str(self.dtype).removeprefix("torch."),
            "slot_steps": self.row_steps(),
            "ring": self.history,
            "persistent_rows": self.persistent_rows,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load `state` (as `state_dict()` returns it, or a resume reads it): its ring,
        any `RingHistory` of this shard's shape, is copied in."""
        check_state(state, "BandMFNoise", 2)
        if (state["start"], state["stop"]) != (self.start, self.stop):
            raise StoredStateError(
                f"ring shard [{state['start']}, {state['stop']}) does not match this "
                f"instance's [{self.start}, {self.stop})"
            )
        load_ring_into(self.history, state["ring"], "ring is")
        self.slot_steps = list(state["slot_steps"])
        self.t = int(state["t"])
