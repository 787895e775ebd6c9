"""The ring history split by columns over tiers, with one GEMV per step.

`TieredHistory` places each tier's shard (contiguous columns, whole allocation units),
writes each new w_t across them, and computes the step's GEMV in the chosen
`GemvMode`: near the data on every tier at once (the tiers run in parallel: threads for
host and device, the worker process for far), or one of the two baselines that pull
every shard to one place. Every mode and every split gives bit-identical results (the
kernel of `cocoon_ckpt.dp.gemv` has one order of rounding).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from cocoon_ckpt.dp.gemv import mix_history
from cocoon_ckpt.tiers.base import GemvMode, Tier, TierError, TierKind
from cocoon_ckpt.tiers.host import HostTier

__all__ = ["TieredHistory"]

#: Columns per chunk when a baseline pulls a shard: the next chunk crosses the link
#: while this one is computed.
PULL_CHUNK_BYTES = 8 << 20


class TieredHistory:
    """(slots, width) ring history over tiers, split by columns: a
    `cocoon_ckpt.dp.ring.RingHistory`, bit-identical to the plain `HostRing`.

    Args:
        slots: b - 1 ring slots.
        width: columns (coordinates) in all.
        dtype: float32 or float64.
        tiers: the tiers in placement order; each takes the next `counts[name]` units.
        counts: allocation units per tier name.
        unit: coordinates per unit (the last unit may be partial).
        mode: where the GEMV runs.
        plan: the plan record kept for checkpoints (profile, capacities).
    """

    def __init__(
        self,
        slots: int,
        width: int,
        dtype: np.dtype[Any] | str,
        tiers: Sequence[Tier],
        counts: dict[str, int],
        unit: int,
        *,
        mode: GemvMode = GemvMode.NEAR_DATA,
        plan: dict[str, Any] | None = None,
    ) -> None:
        self.slots, self.width, self.dtype = slots, width, np.dtype(dtype)
        self._guards: list[Callable[[int], None]] = []
        #: slots written since the tiers were allocated (each tier starts as zeros)
        self._written: set[int] = set()
        self.mode = GemvMode(mode)
        self.unit = unit
        self.plan = plan
        names = [t.name for t in tiers]
        if len(set(names)) != len(names) or set(counts) - set(names):
            raise ValueError(f"counts {counts} must name distinct tiers among {names}")
        need = -(-width // unit) if width else 0
        if sum(counts.values()) != need:
            raise ValueError(f"counts {counts} cover {sum(counts.values())} units, need {need}")
        self.tiers = list(tiers)
        self.ranges: list[tuple[Tier, int, int]] = []
        lo = 0
        try:
            for t in self.tiers:
                hi = min(width, lo + counts.get(t.name, 0) * unit)
                t.allocate(slots, hi - lo, self.dtype)
                self.ranges.append((t, lo, hi))
                lo = hi
        except BaseException:
            self.close()
            raise
        self._device = next((t for t in self.tiers if t.kind is TierKind.DEVICE), None)
        if self.mode is GemvMode.PULL_TO_DEVICE and self._device is None:
            self.close()
            raise ValueError("GemvMode.PULL_TO_DEVICE needs a device tier among the tiers")
        self._pullers = concurrent.futures.ThreadPoolExecutor(
            max_workers=max(1, len(self.tiers)), thread_name_prefix="tier-pull"
        )

    @classmethod
    def single_host(cls, slots: int, width: int, dtype: np.dtype[Any] | str) -> TieredHistory:
        """Everything on one host tier, with no profiling (`build_history` without a
        config). `BandMFNoise` without a history takes the lighter `HostRing`, which
        gives the same bits."""
        dt = np.dtype(dtype)
        tier = HostTier(slots * width * dt.itemsize)
        return cls(slots, width, dt, [tier], {"host": 1 if width else 0}, max(width, 1))

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tiers)

    def placement(self) -> list[dict[str, Any]]:
        """Which columns lie on which tier (the manifest's `noise.placement`)."""
        out = []
        for t, lo, hi in self.ranges:
            if hi > lo:
                rec: dict[str, Any] = {"tier": t.name, "start": lo, "stop": hi}
                if t.kind is TierKind.DEVICE:
                    rec["device"] = str(getattr(t, "device", "cpu"))
                out.append(rec)
        return out

    # -- data ----------------------------------------------------------------------
    def shared_row(self, slot: int) -> np.ndarray | None:
        """A read-only (1, width) view of ring slot `slot` when one host tier holds every
        column (a snapshot writes it from here instead of a copy, `guard_writes`
        guarding it); None otherwise."""
        live = [(t, lo, hi) for t, lo, hi in self.ranges if hi > lo]
        if len(live) != 1 or not isinstance(live[0][0], HostTier) or not 0 <= slot < self.slots:
            return None
        view = live[0][0].ring[slot : slot + 1]
        view.flags.writeable = False
        return view

    def open_slot(self, slot: int) -> np.ndarray | None:
        """The host tier's whole ring, writable (slots, width), once every write guard
        has run for `slot`, when that one tier holds every column (the BandMF step then
        writes w_t straight into the slot: `dp.ring.InPlaceRing`); None otherwise, no
        guard run."""
        live = [(t, lo, hi) for t, lo, hi in self.ranges if hi > lo]
        if len(live) != 1 or not isinstance(live[0][0], HostTier):
            return None
        if not 0 <= slot < self.slots:
            raise IndexError(f"ring slot {slot} is outside [0, {self.slots})")
        for guard in self._guards:
            guard(slot)
        self._written.add(slot)
        ring: np.ndarray = live[0][0].ring
        return ring

    def holds_zeros(self, slot: int) -> bool:
        """Whether ring slot `slot` was never written since its tiers were allocated,
        so it holds zeros (every tier starts so): a restore then need not write its
        zeros again. At 354M parameters, b = 16, a resume onto a new far file wrote
        17.2 GB of zeros for the 12 slots no version stored at step 4 (the uninterrupted
        run's file held 4.6 GB); a new far file's holes read as zeros unwritten."""
        return slot not in self._written

    def add_write_guard(self, guard: Callable[[int], None]) -> None:
        """Call `guard(slot)` before every write to a slot (a snapshot's lent rows are
        copied out or finished first: `format.snapshot.SharedRows`)."""
        self._guards.append(guard)

    def remove_write_guard(self, guard: Callable[[int], None]) -> None:
        """Stop calling `guard` (`add_write_guard`)."""
        self._guards = [g for g in self._guards if g != guard]

    def write(self, slot: int, w: np.ndarray) -> None:
        """Store w (width,) as ring slot `slot`, each tier its columns."""
        for guard in self._guards:
            guard(slot)
        self._written.add(slot)
        for t, lo, hi in self.ranges:
            if hi > lo:
                t.write_slot(slot, w[lo:hi])

    def read(self, slot: int, out: np.ndarray | None = None) -> np.ndarray:
        """Ring slot `slot`, (width,), gathered to the host (into `out` when given)."""
        if out is None:
            out = np.empty(self.width, dtype=self.dtype)
        for t, lo, hi in self.ranges:
            if hi > lo:
                t.read_slot_into(slot, out[lo:hi])
        return out

    def gather(self) -> np.ndarray:
        """The whole ring, (slots, width), on the host."""
        out = np.empty((self.slots, self.width), dtype=self.dtype)
        for s in range(self.slots):
            out[s] = self.read(s)
        return out

    def scatter(self, ring: np.ndarray) -> None:
        """Load a whole ring (slots, width) into the tiers."""
        if ring.shape != (self.slots, self.width):
            raise ValueError(f"ring {ring.shape}, history ({self.slots}, {self.width})")
        for s in range(self.slots):
            self.write(s, np.ascontiguousarray(ring[s], dtype=self.dtype))

    # -- the GEMV --------------------------------------------------------------------
    def gemv(self, mix: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """h = sum_i mix[i] ring[i], (width,), on the host.

        Args:
            mix: (slots,) mixing vector, rotated to the ring's slots.
            out: (width,) host array of `dtype` to write h into (returned); None: a new
                one. Each tier writes its columns of it where it can (a host tier
                directly): a step then faults in no fresh (width,) pages (343 MB at
                85.9M parameters, up to seconds on a VM).
        """
        if out is None:
            out = np.empty(self.width, dtype=self.dtype)
        if self.slots == 0:
            out[...] = 0
            return out
        mix = np.asarray(mix, dtype=self.dtype)
        live = [(t, lo, hi) for t, lo, hi in self.ranges if hi > lo]
        if self.mode is GemvMode.NEAR_DATA:
            # far first: its request crosses a process boundary; then the threads
            futs = [
                t.submit_gemv(mix, out[lo:hi])
                for t, lo, hi in sorted(live, key=lambda r: r[0].kind is not TierKind.FAR)
            ]
            for fut in futs:
                fut.result()
            return out
        for t, lo, hi in live:
            out[lo:hi] = self._pulled_gemv(t, mix)
        return out

    def _compute_pulled(self, mix: np.ndarray, shard: np.ndarray) -> np.ndarray:
        if self.mode is GemvMode.PULL_TO_DEVICE and self._device is not None:
            return self._device.gemv_pulled(mix, shard)  # type: ignore[attr-defined, no-any-return]
        return mix_history(mix, shard)

    def _pulled_gemv(self, t: Tier, mix: np.ndarray) -> np.ndarray:
        """A baseline's GEMV of tier t's shard: computed in place where the baseline
        computes anyway (the device for GPU-GEMV, the host for CPU-GEMV), else pulled in
        column chunks, the next chunk crossing while this one is computed."""
        if (self.mode is GemvMode.PULL_TO_DEVICE and t.kind is TierKind.DEVICE) or (
            self.mode is GemvMode.PULL_TO_HOST and t.kind is TierKind.HOST
        ):
            return t.submit_gemv(mix).result()
        step = max(1, PULL_CHUNK_BYTES // max(1, self.slots * self.dtype.itemsize))
        cuts = list(range(0, t.width, step)) + [t.width]
        out = np.empty(t.width, dtype=self.dtype)
        nxt = self._pullers.submit(t.pull, cuts[0], cuts[1])
        for i in range(len(cuts) - 1):
            shard = nxt.result()
            if i + 2 < len(cuts):
                nxt = self._pullers.submit(t.pull, cuts[i + 1], cuts[i + 2])
            out[cuts[i] : cuts[i + 1]] = self._compute_pulled(mix, shard)
        return out

    def close(self) -> None:
        """Free every tier (stops the far worker). Idempotent."""
        pullers = getattr(self, "_pullers", None)
        if pullers is not None:
            pullers.shutdown(wait=True)
        errors = []
        for t in self.tiers if hasattr(self, "tiers") else []:
            try:
                t.close()
            except Exception as exc:  # close every tier, then report
                errors.append(exc)
        if errors:
            raise TierError(f"closing the tiers failed: {errors}")
