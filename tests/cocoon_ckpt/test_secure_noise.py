"""Secure noise mode (`NoiseRng.SECURE`): ChaCha20 per (t, block), exact Box-Muller."""

from __future__ import annotations

import hashlib
import math
import sys

import numba
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from cocoon_ckpt import BLOCK, BandMF, BandMFNoise, KeyedNoise
from cocoon_ckpt.dp.generator import (
    GENERATOR_BACKEND,
    NoiseRng,
    check_generator_backend,
    generator_backend,
)
from cocoon_ckpt.dp.secure_noise import (
    SECURE_SCHEME,
    box_muller,
    box_muller_reference,
    keystream_words,
)
from cocoon_ckpt.errors import GeneratorMismatchError, MissingExtraError

KEY = bytes(range(32))
THREADS = sorted({1, min(2, numba.config.NUMBA_NUM_THREADS)})  # type: ignore[attr-defined]
OTHER = bytes(range(1, 33))
# Words that hit every fold of the reduction: u = 1 and u = 2^-53, angles on the
# quadrant and octant boundaries and next to them, all bits set.
EDGE = np.array(
    [0, 0, (2**53 - 1) << 11, (2**53 - 1) << 11, 0, (1 << 50) << 11, 0, (1 << 51) << 11]
    + [5 << 11, ((1 << 50) + 1) << 11, 123, ((3 << 51) + 7) << 11, 2**64 - 1, 2**64 - 1],
    dtype=np.uint64,
)


def secure(dim: int, std: float = 1.0, dtype: str = "float64", key: bytes = KEY) -> KeyedNoise:
    return KeyedNoise(key, dim, std, dtype, rng=NoiseRng.SECURE)


def _bits(a: np.ndarray | torch.Tensor) -> bytes:
    return np.asarray(a).tobytes()


def test_known_answer_pins_the_scheme() -> None:
    # chacha20-boxmuller-block65536/v1 must never change silently: a store's noise is
    # regenerated from these bits
    want = [
        "-0x1.743ec6fe100d3p-1",
        "0x1.6b7c45800be9cp-5",
        "-0x1.b3fef899994e5p+0",
        "0x1.10b1b362c8179p+0",
        "-0x1.13946bcce1f59p-2",
        "-0x1.20f38e584342fp+0",
        "0x1.6c5274fb0787ep-4",
        "-0x1.65ad69189fcabp+0",
    ]
    assert [float(x).hex() for x in secure(8).fresh(3)] == want
    assert float(secure(2 * BLOCK).fresh(0)[BLOCK]).hex() == "0x1.3b39c9182db02p-2"


def test_the_scheme_as_documented_from_an_independent_reference() -> None:
    # the docstring's steps, written out with cryptography and mpmath
    mpmath = pytest.importorskip("mpmath")
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

    mpmath.mp.prec = 120
    t, k = 9, 1
    msg = t.to_bytes(8, "little") + k.to_bytes(8, "little")
    bkey = hashlib.blake2b(msg, key=KEY, digest_size=32, person=b"cocoon-secure-z").digest()
    stream = Cipher(algorithms.ChaCha20(bkey, bytes(16)), mode=None).encryptor().update(bytes(64))
    words = [int.from_bytes(stream[8 * i : 8 * i + 8], "little") for i in range(8)]
    got = secure(2 * BLOCK).fresh(t, BLOCK, BLOCK + 8).numpy()
    for i in range(4):
        u = mpmath.mpf((words[2 * i] >> 11) + 1) / 2**53
        v = mpmath.mpf(words[2 * i + 1] >> 11) / 2**53
        r = mpmath.sqrt(-2 * mpmath.log(u))
        for j, ref in enumerate(
            (r * mpmath.cos(2 * mpmath.pi * v), r * mpmath.sin(2 * mpmath.pi * v))
        ):
            assert abs(float(got[2 * i + j]) - ref) <= 4 * 2.0**-53 * max(r, 1)


def test_transform_is_within_a_few_ulp_of_real_box_muller() -> None:
    mpmath = pytest.importorskip("mpmath")
    mpmath.mp.prec = 120
    words = np.concatenate([EDGE, np.random.default_rng(5).integers(0, 2**64, 2000, np.uint64)])
    z = box_muller(words)
    worst = 0.0
    for i, (a, c) in enumerate(words.reshape(-1, 2) >> np.uint64(11)):
        u, v = mpmath.mpf(int(a) + 1) / 2**53, mpmath.mpf(int(c)) / 2**53
        r = mpmath.sqrt(-2 * mpmath.log(u))
        for j, ref in enumerate(
            (r * mpmath.cos(2 * mpmath.pi * v), r * mpmath.sin(2 * mpmath.pi * v))
        ):
            worst = max(worst, float(abs(z[2 * i + j] - ref) / max(r, 1)))
    assert worst <= 4 * 2.0**-53, f"worst error {worst / 2.0**-53:.1f} ulp of max(R, 1)"
    assert np.all(np.abs(z) <= math.sqrt(106 * math.log(2)) + 1e-12)


@pytest.mark.parametrize("threads", THREADS)
def test_compiled_kernel_equals_the_numpy_reference_bit_for_bit(threads: int) -> None:
    # an FMA or a reassociation in the kernel would change some of these bits; two
    # threads run the parallel launch, one the serial loop
    words = np.concatenate([EDGE, keystream_words(bytes(32), 1 << 17)])
    old = numba.get_num_threads()
    try:
        numba.set_num_threads(threads)
        got = box_muller(words)
    finally:
        numba.set_num_threads(old)
    assert _bits(got) == _bits(box_muller_reference(words))
    with pytest.raises(ValueError, match="even count"):
        box_muller(words[:3])


def test_fresh_is_a_pure_function_of_key_t_block() -> None:
    a, b = secure(3 * BLOCK), secure(3 * BLOCK)
    b.fresh(5)
    b.fresh(2, 10, 20)
    assert torch.equal(a.fresh(3), b.fresh(3))
    assert torch.equal(b.fresh(4), a.fresh(4))
    z = a.fresh(3)
    assert not torch.equal(z, a.fresh(4))
    assert not torch.equal(z, secure(3 * BLOCK, key=OTHER).fresh(3))
    assert not torch.equal(z[:BLOCK], z[BLOCK : 2 * BLOCK])
    default = KeyedNoise(KEY, 3 * BLOCK, 1.0, "float64")
    assert not torch.equal(z, default.fresh(3))
    # a block is its own: the same whatever dim it sits in
    assert torch.equal(secure(BLOCK + 5).fresh(3)[:BLOCK], z[:BLOCK])


@settings(max_examples=15)
@given(
    cuts=st.lists(st.integers(0, 3 * BLOCK + 17), min_size=1, max_size=6),
    t=st.integers(0, 2**40),
)
def test_fresh_shards_agree_with_the_whole(cuts: list[int], t: int) -> None:
    kn = secure(3 * BLOCK + 17, 0.7, "float32")
    whole = kn.fresh(t)
    edges = sorted({0, kn.dim, *cuts})
    parts = [kn.fresh(t, a, b) for a, b in zip(edges, edges[1:], strict=False)]
    assert torch.equal(torch.cat(parts), whole)


def test_float32_is_the_float64_noise_rounded_once() -> None:
    z64 = secure(BLOCK + 3, 1.7).fresh(11)
    z32 = secure(BLOCK + 3, 1.7, "float32").fresh(11)
    assert z32.dtype == torch.float32 and z64.dtype == torch.float64
    assert torch.equal(z32, z64.to(torch.float32))
    assert torch.equal(z64, secure(BLOCK + 3).fresh(11) * 1.7)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_statistics_match_the_standard_normal(dtype: str) -> None:
    n = 16 * BLOCK  # ~1e6
    z = secure(n, 1.0, dtype).fresh(42).double().numpy()
    se = 1 / math.sqrt(n)
    assert abs(z.mean()) < 5 * se
    assert abs(z.var() - 1) < 5 * math.sqrt(2) * se
    assert stats.kstest(z, "norm").pvalue > 1e-3
    # the pairs too: cos and sin halves are each standard normal and uncorrelated
    assert stats.kstest(z[1::2], "norm").pvalue > 1e-3
    assert abs(np.corrcoef(z[0::2], z[1::2])[0, 1]) < 5 / math.sqrt(n / 2)
    for c in (1.0, 2.0, 3.0, 4.0):
        p = 2 * stats.norm.sf(c)
        hits = int(np.sum(np.abs(z) > c))
        assert abs(hits - n * p) < 5 * math.sqrt(n * p * (1 - p)) + 2, (c, hits, n * p)


def test_scaled_noise_has_the_asked_std() -> None:
    z = secure(4 * BLOCK, 2.5, "float32").fresh(0).double()
    assert abs(float(z.std()) - 2.5) < 0.02


def test_generator_backend_records_the_scheme_and_refuses_another() -> None:
    sec, default = generator_backend("secure"), generator_backend()
    assert sec["scheme"] == SECURE_SCHEME != default["scheme"] == GENERATOR_BACKEND
    assert generator_backend(NoiseRng.DEFAULT) == default
    check_generator_backend(sec, rng="secure")
    with pytest.raises(GeneratorMismatchError, match="noise_rng"):
        check_generator_backend(default, rng=NoiseRng.SECURE)
    # another scheme is another generator, not another build: refused even if allowed
    with pytest.raises(GeneratorMismatchError, match=SECURE_SCHEME):
        check_generator_backend(sec, allow_change=True)
    with pytest.raises(GeneratorMismatchError, match=r"ResumeAllowances\(generator_change=True\)"):
        check_generator_backend({**sec, "torch": "0.0.1"}, rng="secure")
    check_generator_backend({**sec, "torch": "0.0.1"}, rng="secure", allow_change=True)


def test_rng_is_validated_and_the_key_never_shown() -> None:
    with pytest.raises(ValueError, match="rng='chacha'"):
        KeyedNoise(KEY, 10, 1.0, rng="chacha")
    kn = secure(10)
    assert kn.rng is NoiseRng.SECURE
    assert KEY.hex() not in repr(kn) and "secure" in repr(kn)


def test_missing_cryptography_is_a_missing_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cryptography.hazmat.primitives.ciphers", None)
    with pytest.raises(MissingExtraError, match="cryptography"):
        secure(10)
    KeyedNoise(KEY, 10, 1.0)  # the default needs nothing more


def test_correlated_noise_in_secure_mode_matches_the_dense_solve_and_resumes() -> None:
    mech = BandMF.banded_sqrt(4, 12)
    cn = BandMFNoise(mech, 300, KEY, 1.3, "float64", rng="secure")
    assert cn.fresh_noise.rng is NoiseRng.SECURE
    got = torch.stack([cn.step() for _ in range(12)])
    assert torch.allclose(got, cn.materialize(12), atol=1e-10, rtol=0)
    a = BandMFNoise(mech, 300, KEY, 1.3, "float32", rng="secure")
    for _ in range(5):
        a.step()
    b = BandMFNoise(mech, 300, KEY, 1.3, "float32", rng="secure")
    b.load_state_dict(a.state_dict())
    assert torch.equal(a.step(), b.step())
