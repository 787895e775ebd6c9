"""History GEMV and the full noise step against the read-stream limit, and keyed fresh
noise (default and secure generator) against plain torch.randn, side by side in one
process.

    python bench/noise_step.py [--dim 4194304] [--bands 8 32 64] [--rounds 7] [--fresh-only]
        [--dtype float32]

The read-stream limit is the faster of a numpy sum and a torch sum over the ring's own
bytes: what this process can read from memory. The GEMV reads (b-1) x dim floats once
with the engine's compiled fixed-order kernel (`cocoon_ckpt.dp.gemv.mix_history`); its
bytes/s is divided by the limit (target >= 0.9, floor 0.8). The numpy reference of the
same sum (the engine's kernel before the compiled one) and OpenBLAS sgemv (faster on
some shapes, not split-invariant) are printed beside it. A numpy copy probe (bytes read
+ written, STREAM's convention) is kept for the older figures.

The full noise step (`BandMFNoise.step`: keyed fresh noise, the GEMV, w = (z - h) /
c0, the ring write) is reported as the time the limit needs to read the ring once,
divided by the step's time.

Fresh noise: `KeyedNoise.fresh` over the whole dim (float32, or `--dtype`), with the
default generator (the v2 scheme, `cocoon_ckpt.dp.default_noise`, compiled:
`_ziggurat_kernel`) on torch's threads and on one, the same scheme drawn by numpy's own
generator (the path before the compiled one: the same bits, checked here) on torch's
threads and on one, the retired v1 default (torch mt19937 seeded per block with 63 bits
of which torch kept 32, rebuilt here for the comparison) and the secure one (ChaCha20 +
exact Box-Muller, `cocoon_ckpt.dp.secure_noise`), and torch.randn on the same dim. Each
row prints its ratio to numpy's path (÷numpy: the compiled generator's speed-up). The
default's time per 65,536-value block is split into the keyed BLAKE2b seed, the
SeedSequence that turns it into SFC64's state, and the Gaussians (numpy's and the
compiled ones, one thread); the secure row's into the keystream and the transform.
`--fresh-only` skips the GEMV table.

Each figure is the best of `--rounds` rounds, ours and the baselines alternating within
each round, so a drift in the machine's speed hits both.
"""

from __future__ import annotations

import argparse
import hashlib
import time
from collections.abc import Callable

import numba
import numpy as np
import torch

from cocoon_ckpt import BandMF, BandMFNoise, KeyedNoise
from cocoon_ckpt.dp._ziggurat_kernel import gaussians_into
from cocoon_ckpt.dp.default_noise import (
    block_entropy,
    block_generator,
    block_seed_words,
    keyed_gaussians,
)
from cocoon_ckpt.dp.gemv import mix_history, mix_history_reference
from cocoon_ckpt.dp.noise import BLOCK
from cocoon_ckpt.dp.secure_noise import block_key, box_muller, keystream_words


def timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def best_interleaved(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Best time of each function, the functions alternating within each round."""
    for fn in fns.values():
        fn()  # warm: page faults, JIT cache load, thread pools
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, fn in fns.items():
            best[name] = min(best[name], timed(fn))
    return best


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__)
    p.add_argument("--dim", type=int, default=1 << 22)
    p.add_argument("--bands", type=int, nargs="+", default=[8, 32, 64])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--fresh-only", action="store_true", help="skip the GEMV table")
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    args = p.parse_args()
    if not args.fresh_only:
        gemv_table(args.dim, args.bands, args.rounds)
    fresh_noise(args.dim, args.rounds, args.dtype)


def gemv_table(m: int, bands: list[int], rounds: int) -> None:
    src = np.random.default_rng(0).random(1 << 26, dtype=np.float32)  # 256 MiB
    dst = np.empty_like(src)
    t_copy = best_interleaved({"copy": lambda: np.copyto(dst, src)}, rounds)["copy"]
    copy_bw = 2 * src.nbytes / t_copy
    print(f"probe: numpy copy 256 MiB, {copy_bw / 1e9:.1f} GB/s (read+write)")
    print(f"torch threads {torch.get_num_threads()}")
    print(
        f"{'b':>4} {'MiB':>5} {'limit GB/s':>10} {'by':>5} {'GEMV GB/s':>9} {'÷limit':>7} "
        f"{'÷copy':>6} {'numpy-ref GB/s':>14} {'÷limit':>7} {'BLAS GB/s':>9} "
        f"{'step ms':>8} {'step ÷limit':>11}"
    )
    key = bytes(32)
    rng = np.random.default_rng(0)
    for b in bands:
        mech = BandMF.banded_sqrt(b, 4 * b)
        ring = rng.standard_normal((b - 1, m), dtype=np.float32)
        flat = ring.reshape(-1)
        flat_t = torch.from_numpy(flat)
        mix = mech.mixing_vector(b + 3).astype(np.float32)
        out = np.empty(m, dtype=np.float32)
        step = BandMFNoise(mech, m, key, 1.0)
        for _ in range(b):  # fill the ring
            step.step()
        fns: dict[str, Callable[[], object]] = {
            "numpy_sum": lambda: flat.sum(),  # noqa: B023 - evaluated inside the loop
            "torch_sum": lambda: flat_t.sum(),  # noqa: B023
            "gemv": lambda: mix_history(mix, ring, out),  # noqa: B023
            "step": step.step,
            "reference": lambda: mix_history_reference(mix, ring, out),  # noqa: B023
            "blas": lambda: mix @ ring,  # noqa: B023
        }
        t = best_interleaved(fns, rounds)
        step.close()
        by = "numpy" if t["numpy_sum"] <= t["torch_sum"] else "torch"
        limit = ring.nbytes / min(t["numpy_sum"], t["torch_sum"])
        bw = ring.nbytes / t["gemv"]
        ref_bw = ring.nbytes / t["reference"]
        step_ratio = (ring.nbytes / limit) / t["step"]
        print(
            f"{b:>4} {ring.nbytes / 2**20:>5.0f} {limit / 1e9:>10.1f} {by:>5} "
            f"{bw / 1e9:>9.1f} {bw / limit:>7.2f} {bw / copy_bw:>6.2f} "
            f"{ref_bw / 1e9:>14.1f} {ref_bw / limit:>7.2f} "
            f"{ring.nbytes / t['blas'] / 1e9:>9.1f} {t['step'] * 1e3:>8.1f} {step_ratio:>11.2f}"
        )


def v1_fresh(key: bytes, t: int, m: int, dtype: torch.dtype) -> torch.Tensor:
    """The retired default, `torch-mt19937-blake2b-block65536/v1`: torch's mt19937 per
    block, seeded by 63 bits of keyed BLAKE2b (torch kept the low 32)."""
    gen, out = torch.Generator(), torch.empty(m, dtype=dtype)
    for k in range(-(-m // BLOCK)):
        msg = t.to_bytes(8, "little") + k.to_bytes(8, "little")
        seed = hashlib.blake2b(msg, key=key, digest_size=8, person=b"cocoon-z").digest()
        gen.manual_seed(int.from_bytes(seed, "little") >> 1)
        seg = out[k * BLOCK : (k + 1) * BLOCK]
        if len(seg) == BLOCK:
            torch.randn(BLOCK, generator=gen, dtype=dtype, out=seg)
        else:
            seg[:] = torch.randn(BLOCK, generator=gen, dtype=dtype)[: len(seg)]
    return out


def fresh_noise(m: int, rounds: int, dtype: str = "float32") -> None:
    """Fresh noise throughput: the default compiled and by numpy, v1, secure, randn."""
    key = bytes(32)
    tdtype = getattr(torch, dtype)
    threads = torch.get_num_threads()
    kn = KeyedNoise(key, m, 1.0, dtype)
    ks = KeyedNoise(key, m, 1.0, dtype, rng="secure")
    one = np.empty(m, dtype=dtype)
    ref = np.empty(m, dtype=dtype)
    chunk = 16  # blocks per pass, as KeyedNoise draws them
    words = np.empty(chunk * BLOCK, dtype=np.uint64)
    bkeys = [block_key(key, 7, k) for k in range(chunk)]
    blocks = -(-m // BLOCK)
    entropies = [block_entropy(key, 7, k) for k in range(chunk)]
    seeds = np.array([block_seed_words(e) for e in entropies])
    block_out = np.empty(BLOCK, dtype=dtype)

    def keystream() -> None:
        for k, bkey in enumerate(bkeys):
            keystream_words(bkey, BLOCK, words[k * BLOCK : (k + 1) * BLOCK])

    def numpy_gaussians() -> None:
        for e in entropies:
            block_generator(e).standard_normal(dtype=block_out.dtype, out=block_out)

    def compiled_gaussians() -> None:
        for k in range(chunk):
            gaussians_into(seeds[k : k + 1], block_out, 0, 1.0, BLOCK, 1)

    t = best_interleaved(
        {
            "default": lambda: kn.fresh(7),
            "default-1": lambda: keyed_gaussians(key, 7, 0, m, one, 1.0, 1, compiled=True),
            "numpy": lambda: keyed_gaussians(key, 7, 0, m, ref, 1.0, threads, compiled=False),
            "numpy-1": lambda: keyed_gaussians(key, 7, 0, m, ref, 1.0, 1, compiled=False),
            "v1": lambda: v1_fresh(key, 7, m, tdtype),
            "secure": lambda: ks.fresh(7),
            "randn": lambda: torch.randn(m, dtype=tdtype),
            # the default's parts over 16 blocks, then per block
            "key": lambda: [block_entropy(key, 7, k) for k in range(chunk)],
            "seed": lambda: [block_seed_words(e) for e in entropies],
            "numpy-gauss": numpy_gaussians,
            "compiled-gauss": compiled_gaussians,
            # the secure generator's two parts over 16 blocks, scaled to the dim
            "keystream": keystream,
            "transform": lambda: box_muller(words),
        },
        rounds,
    )
    same = np.array_equal(kn.fresh(7).numpy(), ref) and np.array_equal(one, ref)
    print(
        f"fresh noise, dim {m}, {dtype}, torch threads {threads}, numba threads "
        f"{numba.get_num_threads()}; compiled == numpy bit for bit: {same}"
    )
    for name in ("default", "default-1", "numpy", "numpy-1", "v1", "secure", "randn"):
        print(
            f"  {name:>9} {m / t[name] / 1e6:>7.1f} M samples/s  "
            f"{t[name] * 1e3:>8.1f} ms  ÷numpy {t[name] / t['numpy']:>5.2f}  "
            f"÷randn {t[name] / t['randn']:>5.2f}  ÷v1 {t[name] / t['v1']:>5.2f}  "
            f"÷secure {t[name] / t['secure']:>5.2f}"
        )
    us = {k: t[k] / chunk * 1e6 for k in ("key", "seed", "numpy-gauss", "compiled-gauss")}
    print(
        f"  default, per {BLOCK}-value block, one thread: keyed BLAKE2b seed {us['key']:.1f} us, "
        f"SeedSequence -> SFC64 state {us['seed']:.1f} us, Gaussians numpy "
        f"{us['numpy-gauss']:.0f} us / compiled {us['compiled-gauss']:.0f} us "
        f"(÷numpy {us['compiled-gauss'] / us['numpy-gauss']:.2f})"
    )
    part = {k: t[k] * blocks / chunk for k in ("keystream", "transform")}
    n = chunk * BLOCK
    print(
        f"  secure split: ChaCha20 keystream {part['keystream'] * 1e3:.1f} ms "
        f"({8 * n / t['keystream'] / 1e9:.2f} GB/s), Box-Muller "
        f"{part['transform'] * 1e3:.1f} ms ({n / t['transform'] / 1e6:.1f} M samples/s, "
        f"numba threads {numba.get_num_threads()})"
    )


if __name__ == "__main__":
    main()
