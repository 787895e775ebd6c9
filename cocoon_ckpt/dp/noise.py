"""Keyed fresh noise (I1) and the correlated-noise recursion over a ring history (I2).

Fresh noise z_t on coordinate block k is drawn from a generator re-seeded from
(key, t, k) alone, so any step and any shard can be regenerated independently and the
noise never depends on the tier split, the number of ranks or any resume. The
recursion w_t = (z_t - sum_{j=1..b-1} c_j w_{t-j}) / c_0 keeps the last b-1 outputs in
a ring: step t writes slot t mod (b-1), and the mixing vector is rotated to match, so
no memory is ever shifted. `bandmf_step` is that step's one definition: the online
noise here, the audit's regeneration (`cocoon_ckpt.tools.regenerate`) and the
embedding precompute (`cocoon_ckpt.embedding.precompute`) all run it. The ring is any
`cocoon_ckpt.dp.ring.RingHistory`; `cocoon_ckpt.dp.bandmf_noise.BandMFNoise` streams it.

Two generators realise the fresh noise (`NoiseRng`): the default
(`cocoon_ckpt.dp.default_noise`: numpy's SFC64 seeded per block with 256 keyed bits,
numpy's ziggurat) and the secure one (`cocoon_ckpt.dp.secure_noise`: ChaCha20 and an
exact Box-Muller), for which docs/threat-models.md says what each protects against.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from cocoon_ckpt.dp.default_noise import BLOCK, block_entropy, block_seeds, keyed_gaussians
from cocoon_ckpt.dp.elementwise import sub_div_
from cocoon_ckpt.dp.gemv import COMPILED_MIN_ELEMENTS, mix_history
from cocoon_ckpt.dp.generator import (
    GENERATOR_BACKEND,
    NoiseRng,
    as_noise_rng,
    check_generator_backend,
    generator_backend,
)
from cocoon_ckpt.dp.mechanism import BandMF
from cocoon_ckpt.dp.ring import RingHistory
from cocoon_ckpt.dp.secure_noise import require_backend, secure_gaussians
from state import hooks

__all__ = [
    "BLOCK",
    "GENERATOR_BACKEND",
    "KeyedNoise",
    "NoiseRng",
    "bandmf_step",
    "bandmf_step_in_slot",
    "check_generator_backend",
    "dense_solve",
    "generator_backend",
    "keyed_shard",
]

# Blocks the secure generator transforms in one pass (8 MiB of words): bounds memory
# for any dim; the transform is elementwise, so the grouping changes no bit.
_SECURE_CHUNK = 16
_DTYPES = {"float32": torch.float32, "float64": torch.float64}

BEFORE_FRESH = hooks.declare("noise.before_fresh", "before fresh noise z_t is drawn")
AFTER_FRESH = hooks.declare("noise.after_fresh", "after z_t is drawn, before the GEMV")
AFTER_GEMV = hooks.declare("noise.after_gemv", "after the history GEMV, before the ring is updated")


def _dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        if name not in _DTYPES.values():
            raise ValueError(f"dtype={name} must be torch.float32 or torch.float64")
        return name
    if name not in _DTYPES:
        raise ValueError(f"dtype={name!r} must be 'float32' or 'float64'")
    return _DTYPES[name]


class KeyedNoise:
    """z_t ~ N(0, std^2 I_dim) as a pure function of (key, t, block).

    The key is secret: whoever holds it can regenerate and subtract the noise. It is
    never printed (repr hides it).

    Args:
        key: 32 secret bytes (from `secrets.token_bytes(32)`).
        dim: m, the number of coordinates.
        std: noise standard deviation (sigma * clip).
        dtype: float32 or float64.
        rng: which generator (`NoiseRng`); the default is numpy's SFC64 per block.

    Raises:
        MissingExtraError: rng is secure and the `cryptography` package is missing.
    """

    def __init__(
        self,
        key: bytes,
        dim: int,
        std: float,
        dtype: str | torch.dtype = "float32",
        rng: NoiseRng | str = NoiseRng.DEFAULT,
    ):
        if not isinstance(key, (bytes, bytearray)) or len(key) != 32:
            raise ValueError("noise key must be exactly 32 bytes (use secrets.token_bytes(32))")
        if dim < 1:
            raise ValueError(f"dim={dim} must be >= 1")
        if not (std >= 0 and np.isfinite(std)):
            raise ValueError(f"std={std} must be finite and >= 0")
        self._key = bytes(key)
        self.dim = dim
        self.std = float(std)
        self.dtype = _dtype(dtype)
        self.rng = as_noise_rng(rng)
        if self.rng is NoiseRng.SECURE:
            require_backend()

    @property
    def np_dtype(self) -> np.dtype[Any]:
        """`dtype` as a numpy dtype (what a ring of this noise holds)."""
        return np.dtype(np.float64 if self.dtype == torch.float64 else np.float32)

    def __repr__(self) -> str:
        return f"KeyedNoise(dim={self.dim}, std={self.std}, rng={self.rng.value}, key=<secret>)"

    def block_entropy(self, t: int, block: int) -> int:
        """The 256-bit seed of (t, block) under the default scheme, derived from the key
        with keyed BLAKE2b (`cocoon_ckpt.dp.default_noise.block_entropy`)."""
        return block_entropy(self._key, t, block)

    def block_seeds(self, t: int, start: int, stop: int) -> np.ndarray:
        """The default scheme's SFC64 seed words of the blocks z_t[start:stop] touches,
        (blocks, 3) uint64 (`cocoon_ckpt.dp.default_noise.block_seeds`): as secret as
        the noise they draw."""
        if self.rng is not NoiseRng.DEFAULT:
            raise ValueError(f"block_seeds: the {self.rng.value} generator has no SFC64 seeds")
        return block_seeds(self._key, t, start, stop)

    def fresh(
        self, t: int, start: int = 0, stop: int | None = None, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """z_t[start:stop], shape (stop - start,), in `dtype`: into `out` when given (a
        contiguous CPU tensor of that shape and dtype, returned), else a new tensor.

        Whole blocks are drawn and cut, so any range equals the same slice of the whole.
        """
        stop = self.dim if stop is None else stop
        if not 0 <= start <= stop <= self.dim:
            raise ValueError(f"range [{start}, {stop}) is outside [0, {self.dim})")
        if t < 0:
            raise ValueError(f"step t={t} must be >= 0")
        if out is None:
            out = torch.empty(stop - start, dtype=self.dtype)
        elif (
            out.shape != (stop - start,)
            or out.dtype != self.dtype
            or out.device.type != "cpu"
            or not out.is_contiguous()
        ):
            raise ValueError(
                f"out is {tuple(out.shape)} {out.dtype} on {out.device}; z_t[{start}:{stop}] "
                f"needs a contiguous ({stop - start},) {self.dtype} CPU tensor"
            )
        if stop == start:
            return out
        if self.rng is NoiseRng.SECURE:
            self._fresh_secure(t, start, stop, out)
            return out
        # blocks are independent: drawn on torch's intra-op threads, the same bits
        keyed_gaussians(self._key, t, start, stop, out.numpy(), self.std, torch.get_num_threads())
        return out

    def fresh_at(self, t: int, coords: np.ndarray) -> torch.Tensor:
        """z_t at the coordinates `coords` (any order), (len(coords),) in `dtype`: the
        blocks they fall in drawn whole, as I1 defines them, so each value is the one
        `fresh(t)` gives there (what a regeneration at a few coordinates runs on)."""
        out = torch.empty(len(coords), dtype=self.dtype)
        blocks = coords // BLOCK
        for k in np.unique(blocks):
            lo, hi = int(k) * BLOCK, min((int(k) + 1) * BLOCK, self.dim)
            sel = np.nonzero(blocks == k)[0]
            out[sel] = self.fresh(t, lo, hi)[torch.from_numpy(coords[sel] - lo)]
        return out

    def _fresh_secure(self, t: int, start: int, stop: int, out: torch.Tensor) -> None:
        # z is scaled in float64 and rounded once to the dtype
        last = (stop - 1) // BLOCK + 1
        for k0 in range(start // BLOCK, last, _SECURE_CHUNK):
            k1 = min(k0 + _SECURE_CHUNK, last)
            z = secure_gaussians(self._key, t, k0, k1 - k0, BLOCK)
            lo = k0 * BLOCK
            a, b = max(lo, start), min(k1 * BLOCK, stop)
            seg = z[a - lo : b - lo]
            if self.std != 1.0:
                seg = seg * self.std
            out[a - start : b - start] = torch.from_numpy(seg.astype(self.np_dtype))


def keyed_shard(
    key: bytes,
    dim: int,
    noise_std: float,
    dtype: str | torch.dtype,
    rng: NoiseRng | str,
    start: int,
    stop: int | None,
) -> tuple[KeyedNoise, int, int]:
    """A streaming noise's shard: its keyed fresh noise over `dim` and its bounds
    [start, stop) (stop None: dim), refused outside [0, dim). Both mechanisms' noise
    classes start from it."""
    end = dim if stop is None else stop
    if not 0 <= start <= end <= dim:
        raise ValueError(f"shard [{start}, {stop}) is outside [0, {dim})")
    return KeyedNoise(key, dim, noise_std, dtype, rng), start, end


def dense_solve(fresh_noise: KeyedNoise, c: np.ndarray, start: int, stop: int) -> torch.Tensor:
    """The dense reference of a strategy's noise on [start, stop): w_0..w_{n-1} by a
    triangular solve of C W = Z, (n, stop - start), C the strategy's (n, n) matrix."""
    n = c.shape[0]
    z = torch.stack([fresh_noise.fresh(t, start, stop) for t in range(n)])
    lower = torch.from_numpy(c).to(fresh_noise.dtype)
    w: torch.Tensor = torch.linalg.solve_triangular(lower, z, upper=False)
    return w


def bandmf_step(
    mechanism: BandMF,
    t: int,
    z: torch.Tensor,
    history: RingHistory,
    *,
    mix: np.ndarray | None = None,
    after_gemv: Callable[[int], None] | None = None,
    in_place: bool = False,
    scratch: np.ndarray | None = None,
) -> torch.Tensor:
    """One step of the BandMF recursion, the one definition every caller runs (the
    online noise, the audit's regeneration, the embedding precompute):
    w_t = (z_t - sum_{j=1..b-1} c_j w_{t-j}) / c_0, then w_t goes into ring slot
    t mod (b-1), and s_t w_t is returned (s_t = 1 but for a column-normalized C's tail).

    Bit for bit the same wherever it runs: the history GEMV has one order of rounding
    (`cocoon_ckpt.dp.gemv`), and the subtraction and the division by c_0 are elementwise
    torch operations in `z`'s dtype.

    Args:
        mechanism: the BandMF strategy (b bands).
        t: the step, >= 0; the ring must hold w_{t-b+1}..w_{t-1} (zeros before step 0).
        z: fresh noise z_t at the ring's coordinates, (width,) float32 or float64.
        history: the (b-1, width) ring of past outputs, in `z`'s dtype; updated here.
        mix: `mechanism.mixing_vector(t)`, when the caller has it already (any float
            dtype: it is cast to the ring's first).
        after_gemv: called with t once the GEMV is done, before the ring is written
            (a crash point).
        in_place: w_t is computed into `z` itself (one pass, the same bits:
            `cocoon_ckpt.dp.elementwise`): for a caller whose `z` is its own fresh buffer, which saves two
            (width,) allocations a step (each a fresh 343 MB at 85.9M parameters, whose
            new pages cost more than the arithmetic).
        scratch: a (width,) host array of the ring's dtype the GEMV writes into (the
            caller's, kept from step to step); None: a new one.

    Returns:
        w_t, (width,), a fresh tensor (not a view of the ring), or `z` itself when
        b = 1 and c_0 = 1 or `in_place`.
    """
    slots = mechanism.bands - 1
    c0 = float(mechanism.coefficients[0])
    if not slots:
        # x / 1.0 is x in IEEE arithmetic: b = 1 (c_0 = 1) skips a pass over dim
        return z if c0 == 1.0 else z / c0
    m = mechanism.mixing_vector(t) if mix is None else mix
    h = history.gemv(m) if scratch is None else history.gemv(m, scratch)
    if after_gemv is not None:
        after_gemv(t)
    if in_place:
        w = sub_div_(z, h, c0)  # one pass, the bits of the two kernels below
    else:
        w = (z - torch.from_numpy(h)) / c0
    history.write(t % slots, w.numpy())  # the ring keeps the Toeplitz recursion's C_T^-1 z
    # a column-normalized C = C_T diag(1/s) adds diag(s) C_T^-1 z: s_t is 1.0 except in
    # optimized_colnorm's last b-1 steps, so every other kind returns w unchanged
    scale = mechanism.noise_scale(t)
    return w if scale == 1.0 else w * scale


def bandmf_step_in_slot(
    mechanism: BandMF,
    t: int,
    fresh_noise: KeyedNoise,
    start: int,
    rows: np.ndarray,
    *,
    mix: np.ndarray | None = None,
    scratch: np.ndarray | None = None,
    chunk: int | None = None,
    fused: bool | None = None,
) -> torch.Tensor:
    """`bandmf_step` computed in ring slot t mod (b-1) itself, with no (width,) buffer
    of its own, column chunk by column chunk. Fused (the default generator): one
    compiled pass over each noise block of the chunk, on one thread, computes the GEMV
    of its columns into a buffer of one block (it reads w_{t-b+1}, which the slot still
    holds there), draws its z_t into the slot's columns and computes w = (z - h) / c_0
    there (`cocoon_ckpt.dp._slot_kernel`): one parallel launch a chunk and no scratch.
    Not fused: the GEMV of the chunk's columns into `scratch`, then z_t of those
    coordinates drawn into the slot's chunk, then w = (z - h) / c_0 in place there.

    The same bits as `bandmf_step`, ring and w_t, either way: the GEMV's order of
    rounding is per column (`cocoon_ckpt.dp.gemv`: any column range gives the same
    values), a range of keyed noise equals the same slice of the whole draw (I1), and
    the subtraction and division are elementwise (`cocoon_ckpt.dp.elementwise.sub_div_`);
    the fused pass runs those kernels' own loops.

    Args:
        mechanism: the BandMF strategy, b >= 2, with s_t = 1 at this t (a
            column-normalized C's tail returns s_t w_t, not the ring's row:
            `bandmf_step` runs those steps).
        t: the step, >= 0; the ring must hold w_{t-b+1}..w_{t-1}.
        fresh_noise: the keyed noise z_t is drawn from.
        start: the coordinate of the ring's first column in `fresh_noise`'s space.
        rows: the (b-1, width) ring, a C-contiguous writable host array of
            `fresh_noise`'s dtype whose write guards for slot t mod (b-1) have run
            (`cocoon_ckpt.dp.ring.InPlaceRing.open_slot`); slot t mod (b-1) is written.
        mix: `mechanism.mixing_vector(t)`, when the caller has it already.
        scratch: not fused, a host array of the ring's dtype with at least
            min(chunk, width) elements that each chunk's h is computed into (the
            caller's, kept from step to step); None: a new one. Fused: unused.
        chunk: coordinates per chunk, the cuts at multiples of `chunk` in the key's
            coordinates (with a multiple of the noise's BLOCK, no block is drawn twice);
            None: the whole width at once. Each chunk is a parallel launch of each
            kernel (one fused), which on a loaded machine costs 5-8 ms here
            (`cocoon_ckpt.dp._slot_kernel`): few large chunks.
        fused: True: the fused pass (the default generator only); False: the three
            kernels through `scratch`; None: fused for the default generator from
            `gemv.COMPILED_MIN_ELEMENTS` ring elements on (below, numba's start-up
            would cost more than the step). The same bits.

    Returns:
        w_t, (width,): slot t mod (b-1) of `rows` as a tensor (a view of the ring: read
        it before step t + b - 1 writes the slot again, and never write it).

    Raises:
        ValueError: b = 1, s_t != 1, `rows` is not such an array, or `fused` with
            another generator than the default.
    """
    slots = mechanism.bands - 1
    if not slots or mechanism.noise_scale(t) != 1.0:
        raise ValueError(
            f"bandmf_step_in_slot: step {t} of a {mechanism.bands}-band mechanism has no "
            "ring slot that is its w_t (b = 1, or s_t != 1): run bandmf_step"
        )
    dt = fresh_noise.np_dtype
    if (
        rows.ndim != 2
        or rows.shape[0] != slots
        or rows.dtype != dt
        or not (rows.flags.c_contiguous and rows.flags.writeable)
    ):
        raise ValueError(
            f"bandmf_step_in_slot: rows is {rows.dtype}{rows.shape}; the step needs a "
            f"writable C-contiguous ({slots}, width) {dt} ring"
        )
    width = rows.shape[1]
    if chunk is None:
        chunk = max(width, 1)
    elif chunk < 1:
        raise ValueError(f"bandmf_step_in_slot: chunk={chunk} must be >= 1")
    c0 = float(mechanism.coefficients[0])
    # cast once: the GEMV casts the mixing vector to the ring's dtype anyway
    m = np.ascontiguousarray(mechanism.mixing_vector(t) if mix is None else mix, dtype=dt)
    # which kernels run is decided once for the whole ring (the same bits either way)
    compiled = rows.size >= COMPILED_MIN_ELEMENTS
    default_rng = fresh_noise.rng is NoiseRng.DEFAULT
    if fused is None:
        fused = default_rng and compiled
    elif fused and not default_rng:
        raise ValueError(
            f"bandmf_step_in_slot: fused=True draws the default generator's noise; this "
            f"noise is {fresh_noise.rng.value}'s: pass fused=None or False"
        )
    w = torch.from_numpy(rows[t % slots])
    if fused:
        from cocoon_ckpt.dp._slot_kernel import step_into_slot

        for lo, hi in _chunks(start, start + width, chunk):
            seeds = fresh_noise.block_seeds(t, lo, hi)
            ring = rows[:, lo - start : hi - start]
            step_into_slot(m, ring, t % slots, seeds, lo % BLOCK, fresh_noise.std, c0, BLOCK)
        return w
    if scratch is None:
        scratch = np.empty(min(chunk, width), dtype=dt)
    elif scratch.dtype != dt or scratch.ndim != 1 or len(scratch) < min(chunk, width):
        raise ValueError(
            f"bandmf_step_in_slot: scratch is {scratch.dtype}{scratch.shape}; the step "
            f"needs at least {min(chunk, width)} {dt} elements"
        )
    for lo, hi in _chunks(start, start + width, chunk):
        a, b = lo - start, hi - start
        h = scratch[: b - a]
        mix_history(m, rows[:, a:b], h, compiled=compiled)
        z = fresh_noise.fresh(t, lo, hi, out=w[a:b])
        sub_div_(z, h, c0, compiled=compiled)
    return w


def _chunks(lo: int, stop: int, chunk: int) -> Iterator[tuple[int, int]]:
    """[lo, stop) cut at the multiples of `chunk` (in the key's coordinates), in order."""
    while lo < stop:
        hi = min(stop, (lo // chunk + 1) * chunk)
        yield lo, hi
        lo = hi
