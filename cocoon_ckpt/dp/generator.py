"""The fresh noise's generator: which one draws z_t (`NoiseRng`) and the generator
backend record every manifest carries (I3), with the check a resume runs against it.
"""

from __future__ import annotations

import enum
from typing import Any

import numpy as np
import torch

from cocoon_ckpt.dp.default_noise import DEFAULT_SCHEME
from cocoon_ckpt.dp.gemv import GEMV_SCHEME
from cocoon_ckpt.dp.secure_noise import SECURE_SCHEME
from cocoon_ckpt.errors import GeneratorMismatchError

__all__ = [
    "GENERATOR_BACKEND",
    "LEGACY_SCHEMES",
    "NoiseRng",
    "as_noise_rng",
    "check_generator_backend",
    "generator_backend",
]

#: Name of the default generator scheme; recorded in every manifest (I3).
GENERATOR_BACKEND = DEFAULT_SCHEME
#: Earlier default schemes this release no longer draws, and why each was replaced.
LEGACY_SCHEMES = {
    "torch-mt19937-blake2b-block65536/v1": (
        "torch's mt19937 kept 32 bits of each block's seed, so a block's noise could be "
        "found by trying 2^32 seeds"
    ),
}


class NoiseRng(enum.StrEnum):
    """Which generator draws the fresh noise z_t. Either way z_t is a pure function of
    (key, t, block) (I1); they differ in what an adversary can do with the bits."""

    DEFAULT = "default"
    """numpy's SFC64 seeded per block by 256 bits of keyed BLAKE2b, numpy's ziggurat
    (`default_noise.DEFAULT_SCHEME`): 192 bits of generator state per block; float32
    noise reaches ~8.2 std, float64 ~13.7."""
    SECURE = "secure"
    """ChaCha20 keyed per block, exact Box-Muller in float64 (`secure_noise.SECURE_SCHEME`):
    a cryptographic generator, bits the same on every machine, 53-bit uniforms (|z| up
    to 8.57 std); needs the `cryptography` package."""


def as_noise_rng(rng: NoiseRng | str) -> NoiseRng:
    """`rng` as a NoiseRng; a ValueError names the allowed values."""
    try:
        return NoiseRng(rng)
    except ValueError:
        raise ValueError(f"rng={rng!r} must be one of {[r.value for r in NoiseRng]}") from None


def generator_backend(rng: NoiseRng | str = NoiseRng.DEFAULT) -> dict[str, str]:
    """The generator backend record: the scheme of `rng`; the numpy and torch builds (a
    library may change its sampling algorithm between releases: the default scheme's
    Gaussians come from numpy's, and z meets the BandMF step in torch; the secure scheme
    uses neither's sampling, but the record keeps one shape); and the history GEMV's order
    of rounding (`cocoon_ckpt.dp.gemv`)."""
    return {
        "scheme": SECURE_SCHEME if as_noise_rng(rng) is NoiseRng.SECURE else GENERATOR_BACKEND,
        "numpy": np.__version__,
        "torch": torch.__version__.split("+")[0],
        "gemv": GEMV_SCHEME,
    }


def check_generator_backend(
    recorded: dict[str, Any],
    *,
    rng: NoiseRng | str = NoiseRng.DEFAULT,
    allow_change: bool = False,
) -> None:
    """Refuse to resume on another generator backend unless the caller allows it.

    A store of a retired default scheme (`LEGACY_SCHEMES`) is refused unless
    `allow_change`: its noise cannot be drawn again here, and going on with the new
    default changes the noise from the resume on (as another numpy or torch release
    would). Any other difference of scheme is refused even with `allow_change`: it is
    another generator (a secure job would go on with the default one), not another
    build of the same one.

    Raises:
        GeneratorMismatchError: the record differs from this process's backend.
    """
    now = generator_backend(rng)
    scheme = recorded.get("scheme")
    if scheme in LEGACY_SCHEMES and now["scheme"] == GENERATOR_BACKEND:
        if not allow_change:
            raise GeneratorMismatchError(
                f"the store's noise came from the retired generator scheme {scheme!r} "
                f"({LEGACY_SCHEMES[scheme]}), this release draws {now['scheme']!r}: finish "
                "the job with the cocoon-ckpt release that started it, start a new store, "
                "or pass --allow-generator-change (ResumeAllowances(generator_change=True) in the API) to go on "
                "with the new scheme"
            )
        return
    if scheme != now["scheme"]:
        raise GeneratorMismatchError(
            f"the store's noise came from generator scheme {scheme!r}, this process would "
            f"draw it with {now['scheme']!r} (noise_rng={as_noise_rng(rng).value}): resume "
            "with the noise_rng the job started with"
        )
    if recorded != now and not allow_change:
        raise GeneratorMismatchError(
            f"the store's noise came from generator backend {recorded}, this process has "
            f"{now}: resumed noise would differ from an uninterrupted run. Use the same numpy "
            "and torch releases, or pass --allow-generator-change (ResumeAllowances(generator_change=True) "
            "in the API) to accept the difference"
        )
