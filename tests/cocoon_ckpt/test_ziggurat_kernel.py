"""The compiled default generator (`cocoon_ckpt.dp._ziggurat_kernel`) draws the v2
scheme's bits: equal to numpy's SFC64 + ziggurat (the scheme's definition) over any
(key, t, range, dtype, std), the ziggurat's rare branches included, on any thread
count, and equal to digests stored when the scheme was numpy's alone."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import numba
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cocoon_ckpt.dp._ziggurat_tables import NOR_R
from cocoon_ckpt.dp.default_noise import (
    BLOCK,
    COMPILED_MIN_VALUES,
    block_entropy,
    block_generator,
    block_seed_words,
    keyed_gaussians,
)
from cocoon_ckpt.dp.noise import KeyedNoise

KEY = bytes(range(32))
DTYPES = ["float32", "float64"]

# sha256 of z_t[5 BLOCK - 500 : 8 BLOCK + 500] at t = 123456789, std 0.7, under KEY,
# drawn by numpy's generator before the compiled one existed (stores hold such noise)
GOLDEN = {
    "float32": "8f3d34eabff870507b110a7affa1d171eaab1feb62b5ff1058c2ac2c8b7bf0dc",
    "float64": "b35a6cbf0408ce4b8f30be4922a05b934a9bf2d65e5677665072ae9de32215a4",
}


def draw(
    key: bytes, t: int, start: int, stop: int, dtype: str, std: float, *, compiled: bool
) -> np.ndarray:
    out = np.empty(stop - start, dtype=dtype)
    return keyed_gaussians(key, t, start, stop, out, std, threads=2, compiled=compiled)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("compiled", [False, True])
def test_both_generators_give_the_stored_digest(dtype: str, compiled: bool) -> None:
    z = draw(KEY, 123456789, 5 * BLOCK - 500, 8 * BLOCK + 500, dtype, 0.7, compiled=compiled)
    assert hashlib.sha256(z.tobytes()).hexdigest() == GOLDEN[dtype]


@settings(max_examples=40, deadline=None)
@given(
    key=st.binary(min_size=32, max_size=32),
    t=st.integers(0, 2**63 - 1),
    first=st.integers(0, 2**40),
    offsets=st.tuples(st.integers(0, 2 * BLOCK), st.integers(1, 2 * BLOCK)),
    dtype=st.sampled_from(DTYPES),
    std=st.sampled_from([1.0, 0.7, 3.25e-3, 1e4]),
)
def test_compiled_equals_numpy_on_any_key_step_range_dtype_and_std(
    key: bytes, t: int, first: int, offsets: tuple[int, int], dtype: str, std: float
) -> None:
    # ranges start and end inside blocks, cross block edges, or sit in one block
    start = first * BLOCK + offsets[0]
    stop = start + offsets[1]
    a = draw(key, t, start, stop, dtype, std, compiled=True)
    b = draw(key, t, start, stop, dtype, std, compiled=False)
    assert same_bits(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
def test_many_blocks_equal_numpy_with_every_branch_of_the_ziggurat_taken(dtype: str) -> None:
    # 48 blocks, 3.1M values: the tail (|z| > R, ~1 in 3,800) and the wedges between
    # the rectangles (~1 in 140) are each taken hundreds of times
    n = 48 * BLOCK
    a = draw(KEY, 7, 0, n, dtype, 1.0, compiled=True)
    ref = np.concatenate(
        [block_generator(block_entropy(KEY, 7, k)).standard_normal(BLOCK, dtype) for k in range(48)]
    )
    assert same_bits(a, ref)
    assert np.count_nonzero(np.abs(ref) > NOR_R) > 200
    assert np.abs(ref).max() > 4.5


def test_block_seed_words_are_what_sfc64_takes_from_its_seed_sequence() -> None:
    entropy = block_entropy(KEY, 3, 9)
    words = block_seed_words(entropy)
    assert words.dtype == np.uint64 and words.shape == (3,)
    seq = np.random.SeedSequence(entropy, pool_size=8)
    assert np.array_equal(words, seq.generate_state(3, np.uint64))
    with pytest.raises(ValueError, match="256-bit"):
        block_seed_words(1 << 256)


@pytest.mark.parametrize("dtype", DTYPES)
def test_thread_count_changes_no_bit(dtype: str) -> None:
    start, stop = BLOCK // 3, 9 * BLOCK + 17
    outs = []
    before = numba.get_num_threads()
    try:
        for numba_threads in sorted({1, before}):
            numba.set_num_threads(numba_threads)
            for threads in (1, 2, 8):
                out = np.empty(stop - start, dtype=dtype)
                keyed_gaussians(KEY, 11, start, stop, out, 0.3, threads, compiled=True)
                outs.append(out)
    finally:
        numba.set_num_threads(before)
    assert all(same_bits(o, outs[0]) for o in outs[1:])


@pytest.mark.parametrize("dtype", DTYPES)
def test_keyed_noise_draws_compiled_from_the_threshold_on_with_the_same_bits(dtype: str) -> None:
    dim = COMPILED_MIN_VALUES + 3 * BLOCK // 2
    z = KeyedNoise(KEY, dim, 0.9, dtype).fresh(4).numpy()
    assert z.dtype == np.dtype(dtype)
    assert same_bits(z, draw(KEY, 4, 0, dim, dtype, 0.9, compiled=False))
    # a shard below the threshold (numpy) is the slice of the whole (compiled)
    part = KeyedNoise(KEY, dim, 0.9, dtype).fresh(4, BLOCK - 5, 2 * BLOCK + 5)
    assert torch.equal(part, torch.from_numpy(z[BLOCK - 5 : 2 * BLOCK + 5]))


def test_calls_of_a_block_or_more_go_compiled_once_the_process_has_drawn_the_threshold(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from cocoon_ckpt.dp import _ziggurat_kernel, default_noise

    calls: list[int] = []
    kernel = _ziggurat_kernel.gaussians_into

    def counted(seeds: np.ndarray, *args: object) -> None:
        calls.append(len(seeds))
        kernel(seeds, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(_ziggurat_kernel, "gaussians_into", counted)
    monkeypatch.setattr(default_noise, "_drawn", 0)

    def fresh(start: int, stop: int) -> np.ndarray:
        out = np.empty(stop - start, dtype=np.float32)
        z = keyed_gaussians(KEY, 3, start, stop, out, 1.0, threads=2)
        assert same_bits(z, draw(KEY, 3, start, stop, "float32", 1.0, compiled=False))
        return z

    fresh(0, 4 * BLOCK)  # an embedding precompute's tile: 4 blocks
    assert calls == []  # the process has drawn less than the threshold
    fresh(4 * BLOCK, COMPILED_MIN_VALUES)
    assert calls == [12]  # this call's values reach it
    fresh(BLOCK + 7, 3 * BLOCK)
    assert calls == [12, 2]  # from now on a call of a block or more is compiled
    fresh(0, BLOCK - 1)
    assert calls == [12, 2]  # a small model's partial block stays with numpy


def test_a_wrong_destination_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match="expected float32 or float64"):
        keyed_gaussians(KEY, 0, 0, 10, np.empty(10, dtype=np.float16), 1.0, compiled=True)
    with pytest.raises(ValueError, match="C-contiguous"):
        keyed_gaussians(KEY, 0, 0, 10, np.empty(20)[::2], 1.0, compiled=True)


def test_the_kernels_machine_code_fuses_no_multiply_and_add(tmp_path: Path) -> None:
    # numpy's C rounds (fi[i-1] - fi[i]) u and then adds fi[i]; an FMA would round once
    # and could flip a wedge test at its edge, too rarely for the draws above to show.
    # A fresh numba cache in a child process: code loaded from a cache has no listing.
    script = """
import re, sys
import numpy as np
from cocoon_ckpt.dp import _ziggurat_kernel
from cocoon_ckpt.dp.default_noise import BLOCK, keyed_gaussians
for dtype in (np.float32, np.float64):
    out = np.empty(2 * BLOCK, dtype=dtype)
    keyed_gaussians(bytes(32), 1, 0, 2 * BLOCK, out, 0.5, 1, compiled=True)
listings = _ziggurat_kernel._serial.inspect_asm()
assert len(listings) == 2, listings.keys()
for asm in listings.values():
    assert "mulss" in asm or "mulsd" in asm, "the listing lacks the kernel's arithmetic"
    fused = re.findall(r"\\bvfn?m(?:add|sub)\\w*", asm)
    assert not fused, fused[:3]
print("ok")
"""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    run = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", script],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "ok"
