"""BLT correlated noise w = C^-1 z for one coordinate range, one step at a time.

The BLT counterpart of `cocoon_ckpt.dp.bandmf_noise.BandMFNoise`: the same keyed fresh
noise z_t (`KeyedNoise.fresh(t, start, stop)`, a pure function of (key, t, block), I1),
the same crash points, and `cocoon_ckpt.dp.blt.strategy.blt_step` in place of `bandmf_step`.
The state is d buffers of the shard's width (any `RingHistory`, so the tiers can hold
them) and the next step: d x width floats whatever the number of steps or the
participation, where BandMF keeps b - 1.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from cocoon_ckpt._state_dict import check_state
from cocoon_ckpt.dp.blt.strategy import BLT, blt_step
from cocoon_ckpt.dp.noise import (
    AFTER_FRESH,
    AFTER_GEMV,
    BEFORE_FRESH,
    NoiseRng,
    dense_solve,
    keyed_shard,
)
from cocoon_ckpt.dp.noise_mechanism import replay_rows
from cocoon_ckpt.dp.ring import HostRing, RingHistory, load_ring_into, shard_ring
from cocoon_ckpt.errors import StoredStateError
from state import hooks

__all__ = ["BLTNoise"]


def _after_gemv(t: int) -> None:
    hooks.point(AFTER_GEMV, step=t)


class BLTNoise:
    """A BLT's w_t = C^-1 z for one coordinate range [start, stop): a `NoiseMechanism`
    whose rows are the d buffers, every one rewritten each step.

    State passed in and out explicitly: `state_dict()` holds the next step and the
    live buffers. `materialize(n)` gives the dense reference.

    Args:
        blt: the BLT strategy (d buffers).
        dim: m, the full model dimension (the key's coordinate space).
        key: 32 secret bytes.
        noise_std: sigma * clip.
        dtype: float32 or float64.
        start, stop: the coordinate range this instance serves; whole by default.
        buffers: where the d buffers live, any `RingHistory` of d slots; a `HostRing`
            by default.
        rng: the fresh noise's generator (`NoiseRng`).

    Raises:
        ValueError: the shard or the buffers' shape disagrees (the message names both).
    """

    persistent_rows = False
    """Each step rewrites all d buffers: nothing a parent version stored is current."""

    def __init__(
        self,
        blt: BLT,
        dim: int,
        key: bytes,
        noise_std: float,
        dtype: str | torch.dtype = "float32",
        *,
        start: int = 0,
        stop: int | None = None,
        buffers: RingHistory | None = None,
        rng: NoiseRng | str = NoiseRng.DEFAULT,
    ) -> None:
        self.blt = blt
        self.fresh_noise, self.start, self.stop = keyed_shard(
            key, dim, noise_std, dtype, rng, start, stop
        )
        self.dtype = self.fresh_noise.dtype
        self.t = 0
        self.buffers: RingHistory = shard_ring(
            buffers,
            blt.buffers,
            self.stop - self.start,
            self.fresh_noise.np_dtype.name,
            "BLT buffers are",
        )
        self._mix = blt.mixing_vector

    @property
    def width(self) -> int:
        return self.stop - self.start

    def history_bytes(self) -> int:
        """Bytes of noise state held: d x width x itemsize."""
        return self.buffers.nbytes

    def close(self) -> None:
        """Free the buffers' storage."""
        self.buffers.close()

    def step(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """Produce w_t for the current t, update the buffers, advance t.

        Args:
            out: a contiguous (width,) CPU tensor of `dtype` that w_t is written into
                (kept by the caller); None: a fresh tensor.

        Returns:
            w_t[start:stop], shape (width,): `out` or a fresh tensor.
        """
        t = self.t
        hooks.point(BEFORE_FRESH, step=t)
        z = self.fresh_noise.fresh(t, self.start, self.stop, out)
        hooks.point(AFTER_FRESH, step=t)
        w = blt_step(
            self.blt, t, z, self.buffers, mix=self._mix, after_gemv=_after_gemv, in_place=True
        )
        self.t = t + 1
        return w

    def materialize(self, n: int) -> torch.Tensor:
        """Dense reference: w_0..w_{n-1} by a triangular solve of C W = Z, (n, width).
        Does not touch this instance's state."""
        return dense_solve(self.fresh_noise, self.blt.matrix(n), self.start, self.stop)

    @property
    def state_rows(self) -> RingHistory:
        """The d buffers, (d, width), where the tiers hold them."""
        return self.buffers

    def row_steps(self) -> list[int | None]:
        """The step after which every buffer was taken: t - 1 for all d of them; None
        before step 0."""
        last = self.t - 1 if self.t > 0 else None
        return [last] * self.blt.buffers

    def regenerate_rows(
        self, coords: np.ndarray, rows: Iterable[tuple[int, int]]
    ) -> dict[tuple[int, int], np.ndarray]:
        """Buffers at `coords` after their label's step, replayed from the key by
        `blt_step` from step 0, O(t d) per coordinate (`NoiseMechanism.regenerate_rows`):
        (i, t) is buffer i after step t."""
        return replay_rows(
            rows,
            HostRing(self.blt.buffers, len(coords), self.fresh_noise.np_dtype),
            lambda t, bufs: blt_step(
                self.blt, t, self.fresh_noise.fresh_at(t, coords), bufs, mix=self._mix
            ),
        )

    # state -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The next step and the shard, plus the buffers by reference (`ring`, the live
        `RingHistory`, labelled by `slot_steps`: the `NoiseMechanism` record); copy what
        you keep before the next `step()`."""
        return {
            "kind": "BLTNoise",
            "schema_version": 2,
            "t": self.t,
            "start": self.start,
            "stop": self.stop,
            "dtype": str(self.dtype).removeprefix("torch."),
            "slot_steps": self.row_steps(),
            "ring": self.buffers,
            "persistent_rows": self.persistent_rows,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load `state` (as `state_dict()` returns it, or a resume reads it): its `ring`,
        any `RingHistory` of this shard's (d, width) and dtype, is copied in."""
        check_state(state, "BLTNoise", 2)
        if (state["start"], state["stop"]) != (self.start, self.stop):
            raise StoredStateError(
                f"BLT buffers shard [{state['start']}, {state['stop']}) does not match this "
                f"instance's [{self.start}, {self.stop}); build it for that shard"
            )
        load_ring_into(
            self.buffers,
            state["ring"],
            "BLT buffers are",
            "; build the noise with the stored BLT and dtype",
        )
        self.t = int(state["t"])
