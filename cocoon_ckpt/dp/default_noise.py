"""The default fresh noise: numpy's SFC64 keyed per (t, block) by a 256-bit BLAKE2b
seed, its Gaussians drawn by numpy's ziggurat.

Scheme `numpy-sfc64-blake2b256-block65536/v2`, for block k of step t (n = 65536
coordinates):

1. Entropy: E = BLAKE2b-256(msg = le64(t) || le64(k), key = the noise key,
   person = b"cocoon-sfc64-z"), read as a little-endian 256-bit integer
   (`block_entropy`).
2. Stream: `numpy.random.SFC64(numpy.random.SeedSequence(E, pool_size=8))`: the
   SeedSequence mixes all 256 bits into a 256-bit pool and draws SFC64's 192-bit
   starting state from it (`block_generator`).
3. Values: `numpy.random.Generator(stream).standard_normal(n, dtype)` (numpy's
   ziggurat: 32-bit draws for float32, 64-bit for float64), then multiplied by the std
   in the dtype (`gaussian_block`).

Why this and not what it replaces (`torch-mt19937-blake2b-block65536/v1`): torch's CPU
generator keeps only the low 32 bits of a seed, so each v1 block was one of 2^32
streams, searchable without breaking BLAKE2b. Here every block's stream is chosen by
192 bits of state derived from 256 bits of keyed BLAKE2b; finding it means guessing
the noise key or breaking BLAKE2b. numpy keeps BitGenerator streams and the
SeedSequence algorithm stable across releases, while a Generator method may change its
algorithm between releases (numpy's random compatibility policy, NEP 19): the
generator backend record carries the numpy release for that, as it carries torch's.

Every block has its own generator and its own slice of the output, so blocks are drawn
on several threads with no change to any bit, and any range is the same slice of the
whole (I1). Steps 2-3 run compiled (`cocoon_ckpt.dp._ziggurat_kernel`: numpy's SFC64
and ziggurat, the same operations in the same order, ~3.5x numpy's speed here) once a
process has drawn `COMPILED_MIN_VALUES`; numpy's own generator, above, stays the
scheme's definition, and tests/cocoon_ckpt/test_ziggurat_kernel.py holds the two equal
bit for bit.
"""

from __future__ import annotations

import hashlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

__all__ = [
    "BLOCK",
    "COMPILED_MIN_VALUES",
    "DEFAULT_SCHEME",
    "block_entropy",
    "block_generator",
    "block_seed_words",
    "block_seeds",
    "gaussian_block",
    "keyed_gaussians",
]

#: Name of the default generator scheme; recorded in the generator backend (I3).
DEFAULT_SCHEME = "numpy-sfc64-blake2b256-block65536/v2"
#: Coordinates per fresh-noise block: the unit every shard split aligns to.
BLOCK = 1 << 16

#: Values a process draws with numpy before `keyed_gaussians` goes compiled (the same
#: bits): a process's first compiled call costs about 1 s (numba's start-up and the
#: kernel's load from its on-disk cache); 16 blocks take ~8 ms in numpy, so a small
#: model never earns it back. A call of less than a block stays with numpy.
COMPILED_MIN_VALUES = 16 * BLOCK

_PERSON = b"cocoon-sfc64-z"
_POOL_WORDS = 8  # SeedSequence pool of 8 x 32 bits: all 256 bits of entropy are kept

_drawn = 0  # values this process has drawn (a racy count: it only picks the path)
_pool_lock = threading.Lock()
_pool: tuple[int, int, ThreadPoolExecutor] | None = None  # (pid, workers, executor)


def block_entropy(key: bytes, t: int, block: int) -> int:
    """The 256-bit seed of (t, block): keyed BLAKE2b of the noise key (a PRF), so one
    block's seed says nothing about another's or about the key."""
    msg = int(t).to_bytes(8, "little") + int(block).to_bytes(8, "little")
    digest = hashlib.blake2b(msg, key=key, digest_size=32, person=_PERSON).digest()
    return int.from_bytes(digest, "little")


def block_generator(entropy: int) -> np.random.Generator:
    """The generator a block's 256-bit seed selects (step 2 of the scheme)."""
    if not 0 <= entropy < 1 << 256:
        raise ValueError(f"entropy={entropy} must be a 256-bit non-negative integer")
    seq = np.random.SeedSequence(entropy, pool_size=_POOL_WORDS)
    return np.random.Generator(np.random.SFC64(seq))


def block_seed_words(entropy: int) -> np.ndarray:
    """The three words that seed the block's SFC64 (`numpy.random.SFC64` draws them from
    its SeedSequence so): (3,) uint64."""
    if not 0 <= entropy < 1 << 256:
        raise ValueError(f"entropy={entropy} must be a 256-bit non-negative integer")
    seq = np.random.SeedSequence(entropy, pool_size=_POOL_WORDS)
    return seq.generate_state(3, np.uint64)


def block_seeds(key: bytes, t: int, start: int, stop: int) -> np.ndarray:
    """The SFC64 seed words of every block z_t[start:stop] touches, in order:
    (blocks, 3) uint64, what the compiled generator draws from."""
    blocks = range(start // BLOCK, (stop - 1) // BLOCK + 1)
    return np.array([block_seed_words(block_entropy(key, t, k)) for k in blocks], np.uint64)


def gaussian_block(entropy: int, out: np.ndarray, std: float = 1.0) -> np.ndarray:
    """One block's noise from its seed, written into `out` (steps 2-3 of the scheme).

    Args:
        entropy: the block's 256-bit seed (`block_entropy`).
        out: (BLOCK,) C-contiguous float32 or float64, written.
        std: the standard deviation, applied in `out`'s dtype.

    Returns:
        `out`.
    """
    if out.shape != (BLOCK,) or out.dtype not in (np.float32, np.float64):
        raise ValueError(f"out is {out.dtype}{out.shape}, expected float32 or float64 ({BLOCK},)")
    block_generator(entropy).standard_normal(dtype=out.dtype, out=out)
    if std != 1.0:
        np.multiply(out, out.dtype.type(std), out=out)
    return out


def _executor(workers: int) -> ThreadPoolExecutor:
    # One pool per process and size: a pool inherited through fork has no threads
    # behind it (work sent to it would never run), so a new pid gets a new pool.
    global _pool
    with _pool_lock:
        pid = os.getpid()
        if _pool is None or _pool[:2] != (pid, workers):
            if _pool is not None and _pool[0] == pid:
                _pool[2].shutdown(wait=False)
            _pool = (pid, workers, ThreadPoolExecutor(workers, thread_name_prefix="cocoon-z"))
        return _pool[2]


def keyed_gaussians(
    key: bytes,
    t: int,
    start: int,
    stop: int,
    out: np.ndarray,
    std: float,
    threads: int = 1,
    *,
    compiled: bool | None = None,
) -> np.ndarray:
    """z_t[start:stop] of the default scheme, written into `out`.

    Whole blocks are drawn and cut, so any range equals the same slice of the whole.

    Args:
        key: the 32-byte noise key.
        t: the step, >= 0.
        start, stop: the coordinate range, start < stop.
        out: (stop - start,) C-contiguous float32 or float64, written.
        std: the standard deviation, applied in `out`'s dtype.
        threads: blocks drawn at once (the bits do not depend on it).
        compiled: True: the compiled generator; False: numpy's; None: compiled for a
            call of a block or more once the process has drawn `COMPILED_MIN_VALUES`
            values, this call's included (the embedding precompute draws a few blocks
            per call, many calls). The result is the same.

    Returns:
        `out`.
    """
    if out.shape != (stop - start,) or not out.flags.c_contiguous:
        raise ValueError(f"out is {out.dtype}{out.shape}, expected C-contiguous ({stop - start},)")
    if out.dtype not in (np.float32, np.float64):
        raise ValueError(f"out is {out.dtype}, expected float32 or float64")
    blocks = range(start // BLOCK, (stop - 1) // BLOCK + 1)
    if compiled is None:
        global _drawn
        _drawn += stop - start
        compiled = stop - start >= BLOCK and _drawn >= COMPILED_MIN_VALUES
    if compiled:
        from cocoon_ckpt.dp._ziggurat_kernel import gaussians_into

        seeds = block_seeds(key, t, start, stop)
        gaussians_into(seeds, out.view(np.ndarray), start % BLOCK, std, BLOCK, threads)
        return out

    def draw(k: int) -> None:
        lo = k * BLOCK
        a, z = max(lo, start), min(lo + BLOCK, stop)
        seed = block_entropy(key, t, k)
        if z - a == BLOCK:
            gaussian_block(seed, out[a - start : z - start], std)
        else:
            # The ziggurat emits its values in order, so the block's first z - lo values
            # are a prefix of the whole block's: the same bits, without drawing the rest
            # (a small model's whole noise is one partial block: 6.2 ms -> 0.3 ms at 4,810).
            buf = block_generator(seed).standard_normal(z - lo, dtype=out.dtype)
            if std != 1.0:
                np.multiply(buf, out.dtype.type(std), out=buf)
            out[a - start : z - start] = buf[a - lo :]

    workers = max(1, min(threads, len(blocks)))
    if workers == 1:
        for k in blocks:
            draw(k)
    else:
        list(_executor(workers).map(draw, blocks))  # iterating raises a worker's error
    return out
