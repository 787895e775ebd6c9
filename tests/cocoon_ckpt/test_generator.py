"""The default fresh-noise generator (`numpy-sfc64-blake2b256-block65536/v2`) and the
generator backend record: a per-block seed space far beyond 32 bits, I1 purity, the
distribution, and the refusal to resume a store of the retired v1 scheme."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from cocoon_ckpt import BLOCK, KeyedNoise
from cocoon_ckpt.dp.default_noise import (
    DEFAULT_SCHEME,
    block_entropy,
    block_generator,
    gaussian_block,
    keyed_gaussians,
)
from cocoon_ckpt.dp.generator import (
    GENERATOR_BACKEND,
    LEGACY_SCHEMES,
    check_generator_backend,
    generator_backend,
)
from cocoon_ckpt.errors import GeneratorMismatchError

KEY = bytes(range(32))
V1 = "torch-mt19937-blake2b-block65536/v1"


def block(entropy: int, dtype: type[np.floating] = np.float64) -> np.ndarray:
    return gaussian_block(entropy, np.empty(BLOCK, dtype=dtype))


@pytest.mark.parametrize("bit", [0, 31, 32, 33, 63, 64, 127, 128, 191, 192, 255])
def test_every_bit_of_the_256_bit_seed_changes_the_block(bit: int) -> None:
    # v1's flaw: torch kept the low 32 bits of a seed, so seeds equal mod 2^32 gave the
    # same stream; here a seed differing in any one bit, high bits included, must not
    seed = block_entropy(KEY, 3, 1)
    other = seed ^ (1 << bit)
    a, b = block(seed), block(other)
    assert not np.array_equal(a, b)
    # not a shifted or partly shared stream either: the blocks are unrelated
    assert np.count_nonzero(a == b) < 10
    assert abs(np.corrcoef(a, b)[0, 1]) < 0.05


def test_seeds_equal_modulo_2_to_the_64_and_128_draw_different_blocks() -> None:
    seed = block_entropy(KEY, 0, 0)
    low = seed & ((1 << 32) - 1)
    blocks = [block(low + (j << 32)) for j in (0, 1, 1 << 32, 1 << 96, 1 << 200)]
    for i, a in enumerate(blocks):
        for b in blocks[i + 1 :]:
            assert not np.array_equal(a, b)
    with pytest.raises(ValueError, match="256-bit"):
        block_generator(1 << 256)


def test_block_entropy_is_256_keyed_bits() -> None:
    seeds = {block_entropy(KEY, t, k) for t in range(8) for k in range(8)}
    assert len(seeds) == 64
    assert max(seeds).bit_length() > 250  # all 32 bytes are used, not 63 bits
    other = bytes(31) + b"\x01"
    assert block_entropy(other, 0, 0) != block_entropy(KEY, 0, 0)
    # what KeyedNoise draws is the scheme applied to that seed
    z = KeyedNoise(KEY, BLOCK, 1.0, "float64").fresh(5)
    assert np.array_equal(z.numpy(), block(block_entropy(KEY, 5, 0)))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_fresh_is_pure_across_calls_instances_threads_and_shards(dtype: str) -> None:
    dim = 5 * BLOCK + 123
    a, b = KeyedNoise(KEY, dim, 0.7, dtype), KeyedNoise(KEY, dim, 0.7, dtype)
    b.fresh(9)
    whole = a.fresh(4)
    assert whole.dtype == getattr(torch, dtype)
    assert torch.equal(whole, b.fresh(4)) and torch.equal(whole, a.fresh(4))
    assert not torch.equal(whole, a.fresh(5))
    np_dtype = np.dtype(dtype)
    for threads in (1, 2, 3, 8):
        out = np.empty(dim, dtype=np_dtype)
        assert np.array_equal(keyed_gaussians(KEY, 4, 0, dim, out, 0.7, threads), whole.numpy())
    # std is applied in the dtype, after the draw
    unit = KeyedNoise(KEY, dim, 1.0, dtype).fresh(4).numpy()
    assert np.array_equal(whole.numpy(), unit * np_dtype.type(0.7))


@settings(max_examples=20, deadline=None)
@given(
    cuts=st.lists(st.integers(0, 3 * BLOCK + 17), min_size=1, max_size=6),
    t=st.integers(0, 2**40),
    dtype=st.sampled_from(["float32", "float64"]),
)
def test_any_shard_is_the_slice_of_the_whole(cuts: list[int], t: int, dtype: str) -> None:
    dim = 3 * BLOCK + 17
    kn = KeyedNoise(KEY, dim, 1.3, dtype)
    whole = kn.fresh(t)
    edges = sorted({0, dim, *cuts})
    for lo, hi in zip(edges, edges[1:], strict=False):
        assert torch.equal(kn.fresh(t, lo, hi), whole[lo:hi])


def test_a_block_does_not_depend_on_the_dim_it_sits_in() -> None:
    z = KeyedNoise(KEY, 3 * BLOCK, 1.0).fresh(2)
    assert torch.equal(KeyedNoise(KEY, BLOCK + 5, 1.0).fresh(2)[:BLOCK], z[:BLOCK])
    assert not torch.equal(z[:BLOCK], z[BLOCK : 2 * BLOCK])


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_distribution_is_standard_normal(dtype: str) -> None:
    z = KeyedNoise(KEY, 16 * BLOCK, 1.0, dtype).fresh(11).numpy().astype(np.float64)
    n = z.size  # ~1e6
    assert abs(z.mean()) < 5 / math.sqrt(n)
    assert abs(z.var() - 1.0) < 5 * math.sqrt(2 / n)
    assert abs(stats.skew(z)) < 5 * math.sqrt(6 / n)
    assert abs(stats.kurtosis(z)) < 5 * math.sqrt(24 / n)
    assert stats.kstest(z, "norm").pvalue > 1e-4
    # the tails are there: torch's float32 randn never passed 5.77 std
    assert np.count_nonzero(np.abs(z) > 4.5) > 0


def test_record_names_the_scheme_and_the_numpy_release() -> None:
    rec = generator_backend()
    assert rec["scheme"] == GENERATOR_BACKEND == DEFAULT_SCHEME
    assert rec["numpy"] == np.__version__
    assert set(rec) == {"scheme", "numpy", "torch", "gemv"}
    check_generator_backend(rec)
    with pytest.raises(GeneratorMismatchError, match=r"ResumeAllowances\(generator_change=True\)"):
        check_generator_backend({**rec, "numpy": "1.0.0"})
    check_generator_backend({**rec, "numpy": "1.0.0"}, allow_change=True)


def test_a_v1_store_is_refused_naming_both_schemes_and_the_way_out() -> None:
    assert V1 in LEGACY_SCHEMES
    v1 = {"scheme": V1, "torch": torch.__version__.split("+")[0], "gemv": "any"}
    with pytest.raises(GeneratorMismatchError) as err:
        check_generator_backend(v1)
    msg = str(err.value)
    assert "\n" not in msg
    assert V1 in msg and DEFAULT_SCHEME in msg and "2^32" in msg
    assert "release that started it" in msg and "new store" in msg
    assert "ResumeAllowances(generator_change=True)" in msg
    check_generator_backend(v1, allow_change=True)
    # allowing a change of build never turns a store into another mode's
    with pytest.raises(GeneratorMismatchError, match="noise_rng"):
        check_generator_backend(v1, rng="secure", allow_change=True)
