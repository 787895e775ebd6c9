"""Secure fresh noise: a ChaCha20 keystream per (t, block), turned into Gaussians by a
Box-Muller transform built from IEEE-754 basic operations only.

Scheme `chacha20-boxmuller-block65536/v1`, for block k of step t (n = 65536 coordinates):

1. Block key: K = BLAKE2b-256(msg = le64(t) || le64(k), key = the noise key,
   person = b"cocoon-secure-z"). Every (t, k) has its own key, so the nonce can be fixed.
2. Bits: the first 8n bytes of the ChaCha20 keystream under K (RFC 8439 block function,
   block counter 0, nonce 0), read as n little-endian uint64 words w_0..w_{n-1}.
3. Uniforms, for each pair i < n/2: a = w_{2i} >> 11 and c = w_{2i+1} >> 11 (53-bit
   integers); u = (a + 1) 2^-53 in (0, 1], v = c 2^-53 in [0, 1).
4. Gaussians: z_{2i} = R cos(2 pi v), z_{2i+1} = R sin(2 pi v), R = sqrt(-2 ln u), in
   float64; the caller scales by std in float64 and rounds once to the dtype.

What is exact. The uniforms are exact: u and v are the 53-bit grid values above, no
rounding. The transform uses only +, -, *, /, sqrt (correctly rounded in IEEE 754),
`frexp` and integer operations, never the platform's libm or a SIMD math library (numpy's
log/sin/cos differ between CPUs and releases): so z is bit-identical on every IEEE-754
machine and numpy release, which is what I1 asks. ln is a Taylor series of 2 atanh after
an exact reduction by frexp; sin and cos are Taylor series on [0, pi/4] after an exact
reduction of v by its top bits (quadrant and octant folds are integer operations). Each z
is within a few ulp of the real-number Box-Muller of (u, v) (tests bound it against
mpmath); the distribution of the pair is exactly Box-Muller's at the 2^53 x 2^53 grid of
(u, v), so |z| <= sqrt(106 ln 2) ~ 8.57 and any event's probability differs from the
Gaussian's by the grid's discretisation, 2^-53 per uniform.

What it does not make exact: the rounding of z to float32, and every later operation on
it (the BandMF recursion, the addition to the gradient sum) are ordinary floating point;
docs/threat-models.md says what that leaves open (Mironov 2012's attack on the
addition).
"""

from __future__ import annotations

import functools
import hashlib
import sys
from decimal import Decimal
from fractions import Fraction
from math import factorial
from typing import Any

import numpy as np

from cocoon_ckpt.errors import MissingExtraError

__all__ = [
    "SECURE_SCHEME",
    "block_key",
    "box_muller",
    "box_muller_reference",
    "keystream_words",
    "require_backend",
    "secure_gaussians",
]

#: Name of the secure generator scheme; recorded in the generator backend (I3).
SECURE_SCHEME = "chacha20-boxmuller-block65536/v1"

_PERSON = b"cocoon-secure-z"
# pi to 50 digits, so every coefficient below is the correctly rounded double of the
# exact real, computed the same way on every machine (float(Fraction) rounds correctly).
_PI = Fraction(Decimal("3.14159265358979323846264338327950288419716939937510"))
_TERMS = 10  # (pi/4)^21 / 21! < 2^-60: the series' tail is below one ulp
_SIN = [float((-1) ** j * (2 * _PI) ** (2 * j + 1) / factorial(2 * j + 1)) for j in range(_TERMS)]
_COS = [float((-1) ** j * (2 * _PI) ** (2 * j) / factorial(2 * j)) for j in range(_TERMS)]
# 2 atanh(s) = 2 sum s^(2j+1) / (2j+1); |s| <= 3 - 2 sqrt(2), s^2 <= 0.0295, 12 terms
_ATANH = [float(Fraction(2, 2 * j + 1)) for j in range(12)]
# ln 2 split so that e * _LN2_HI is exact for |e| < 2^11 (fdlibm's split)
_LN2_HI = float.fromhex("0x1.62e42fee00000p-1")
_LN2_LO = float.fromhex("0x1.a39ef35793c76p-33")
_SQRT_HALF = float.fromhex("0x1.6a09e667f3bcdp-1")
_TWO_M53 = 2.0**-53
_MANTISSA = (1 << 53) - 1
_OCTANT = 1 << 50  # 1/8 turn in units of 2^-53
_QUADRANT = 1 << 51  # 1/4 turn


def _chacha20() -> Any:
    try:
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
    except ImportError:
        raise MissingExtraError(
            "noise_rng='secure' needs the cryptography package for ChaCha20: "
            "pip install 'cocoon-ckpt[secure]', or use noise_rng='default'"
        ) from None
    return Cipher, algorithms.ChaCha20


def require_backend() -> None:
    """Raise MissingExtraError now if the ChaCha20 backend is not installed."""
    _chacha20()


def block_key(key: bytes, t: int, block: int) -> bytes:
    """The 32-byte ChaCha20 key of (t, block), derived from the noise key by keyed
    BLAKE2b (a PRF): knowing one block's key says nothing about another's."""
    msg = int(t).to_bytes(8, "little") + int(block).to_bytes(8, "little")
    return hashlib.blake2b(msg, key=key, digest_size=32, person=_PERSON).digest()


@functools.lru_cache(maxsize=2)
def _zeros(nbytes: int) -> bytes:
    return bytes(nbytes)


def keystream_words(bkey: bytes, n: int, out: np.ndarray | None = None) -> np.ndarray:
    """The first n little-endian uint64 words of the ChaCha20 keystream under `bkey`
    (counter 0, nonce 0).

    Args:
        bkey: 32 bytes, a block key.
        n: words.
        out: (n,) C-contiguous uint64 to write into (3-6x faster here than a new
            buffer: the keystream is written in place, not copied out of bytes).

    Returns:
        (n,) uint64: `out` when given.
    """
    cipher, chacha20 = _chacha20()
    if out is None:
        out = np.empty(n, dtype=np.uint64)
    if out.shape != (n,) or out.dtype != np.uint64 or not out.flags.c_contiguous:
        raise ValueError(f"out is {out.dtype}{out.shape}, expected C-contiguous uint64 ({n},)")
    enc = cipher(chacha20(bkey, bytes(16)), mode=None).encryptor()
    enc.update_into(_zeros(8 * n), out.data.cast("B"))
    if sys.byteorder == "big":
        out.byteswap(inplace=True)  # the scheme reads the bytes little-endian
    return out


def _horner(coefs: list[float], y: np.ndarray) -> np.ndarray:
    acc = np.full_like(y, coefs[-1])
    for c in reversed(coefs[:-1]):
        acc *= y
        acc += c
    return acc


def _neg_two_ln(a: np.ndarray) -> np.ndarray:
    """-2 ln u for u = (a + 1) 2^-53, a (n,) uint64 < 2^53; (n,) float64."""
    u = (a + np.uint64(1)).astype(np.float64) * _TWO_M53  # exact: a + 1 <= 2^53
    m, e = np.frexp(u)  # u = m 2^e, m in [1/2, 1): exact
    low = m < _SQRT_HALF
    m = np.where(low, m * 2.0, m)  # now in [sqrt(1/2), sqrt(2)): exact
    ef = (e - low).astype(np.float64)
    f = m - 1.0  # exact (Sterbenz)
    s = f / (2.0 + f)
    ln_m = s * _horner(_ATANH, s * s)
    # ln u = e ln2 + ln m, the small parts first
    out: np.ndarray = -2.0 * (ef * _LN2_HI + (ef * _LN2_LO + ln_m))
    return out


def _turn(c: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(cos 2 pi v, sin 2 pi v) for v = c 2^-53, c (n,) uint64 < 2^53."""
    quadrant = c >> np.uint64(51)
    r = c & np.uint64(_QUADRANT - 1)  # v = quadrant / 4 + r 2^-53, r 2^-53 < 1/4
    fold = r > np.uint64(_OCTANT)
    r = np.where(fold, np.uint64(_QUADRANT) - r, r)  # now <= 1/8 turn: integer, exact
    s = r.astype(np.float64) * _TWO_M53  # exact: r <= 2^50
    y = s * s
    sin = s * _horner(_SIN, y)
    cos = _horner(_COS, y)
    # a fold at 1/8 turn swaps sin and cos (angle pi/2 - phi)
    cos, sin = np.where(fold, sin, cos), np.where(fold, cos, sin)
    odd = (quadrant & np.uint64(1)).astype(bool)
    cos, sin = np.where(odd, -sin, cos), np.where(odd, cos, sin)  # + pi/2
    half = quadrant >= np.uint64(2)
    return np.where(half, -cos, cos), np.where(half, -sin, sin)  # + pi


def box_muller_reference(words: np.ndarray) -> np.ndarray:
    """Gaussians from uint64 words, two per pair (steps 3-4 of the scheme), in numpy: the
    definition the compiled kernel is tested against bit for bit.

    Args:
        words: (n,) uint64, n even.

    Returns:
        (n,) float64, z_{2i} = R cos(2 pi v_i), z_{2i+1} = R sin(2 pi v_i).
    """
    pairs = words.reshape(-1, 2) >> np.uint64(11)
    radius = np.sqrt(_neg_two_ln(pairs[:, 0]))
    cos, sin = _turn(pairs[:, 1])
    out = np.empty((len(pairs), 2), dtype=np.float64)
    np.multiply(radius, cos, out=out[:, 0])
    np.multiply(radius, sin, out=out[:, 1])
    return out.reshape(-1)


_COEFS = (
    np.array(_SIN),
    np.array(_COS),
    np.array(_ATANH),
    np.array([_LN2_HI, _LN2_LO, _SQRT_HALF, _TWO_M53]),
)


def box_muller(words: np.ndarray, *, compiled: bool = True) -> np.ndarray:
    """Gaussians from uint64 words, two per pair: `box_muller_reference`'s bits, by the
    compiled kernel (`compiled=False`: by the numpy reference).

    Args:
        words: (n,) uint64, n even.

    Returns:
        (n,) float64.
    """
    if len(words) % 2:
        raise ValueError(f"words has {len(words)} entries; Box-Muller needs an even count")
    if not compiled:
        return box_muller_reference(words)
    from cocoon_ckpt.dp._boxmuller_kernel import box_muller_kernel

    out = np.empty(len(words), dtype=np.float64)
    box_muller_kernel(np.ascontiguousarray(words, dtype=np.uint64), out, _COEFS)
    return out


def secure_gaussians(key: bytes, t: int, first: int, count: int, block: int) -> np.ndarray:
    """Blocks first..first+count-1 of step t, (count * block,) float64 ~ N(0, 1).

    Args:
        key: the 32-byte noise key.
        t: the step.
        first: the first block's index.
        count: how many blocks.
        block: coordinates per block (even; the scheme fixes 65536).
    """
    words = np.empty(count * block, dtype=np.uint64)
    for i in range(count):
        keystream_words(block_key(key, t, first + i), block, words[i * block : (i + 1) * block])
    # one pass over all the blocks: the transform is elementwise, so its result does
    # not depend on how the blocks are grouped
    return box_muller(words)
