"""The fresh noise's generator: which one draws z_t (`NoiseRng`) and the generator
backend record every manifest carries (I3), with the check a resume runs against it.
"""

from __future__ import annotations

import enum
from typing import Any

import torch

from cocoon_ckpt.dp.gemv import GEMV_SCHEME
from cocoon_ckpt.dp.secure_noise import SECURE_SCHEME
from cocoon_ckpt.errors import GeneratorMismatchError

__all__ = [
    "GENERATOR_BACKEND",
    "NoiseRng",
    "as_noise_rng",
    "check_generator_backend",
    "generator_backend",
]

#: Name of the default generator scheme; recorded in every manifest (I3).
GENERATOR_BACKEND = "torch-mt19937-blake2b-block65536/v1"


class NoiseRng(enum.StrEnum):
    """Which generator draws the fresh noise z_t. Either way z_t is a pure function of
    (key, t, block) (I1); they differ in what an adversary can do with the bits."""

    DEFAULT = "default"
    """torch's mt19937, seeded per block from keyed BLAKE2b (`GENERATOR_BACKEND`). torch
    keeps only the low 32 bits of a seed, so each block's stream is one of 2^32; float32
    noise comes from 24-bit uniforms and never exceeds ~5.77 std."""
    SECURE = "secure"
    """ChaCha20 keyed per block, exact Box-Muller in float64 (`secure_noise.SECURE_SCHEME`):
    a 256-bit key per block and 53-bit uniforms; needs the `cryptography` package."""


def as_noise_rng(rng: NoiseRng | str) -> NoiseRng:
    """`rng` as a NoiseRng; a ValueError names the allowed values."""
    try:
        return NoiseRng(rng)
    except ValueError:
        raise ValueError(f"rng={rng!r} must be one of {[r.value for r in NoiseRng]}") from None


def generator_backend(rng: NoiseRng | str = NoiseRng.DEFAULT) -> dict[str, str]:
    """The generator backend record: the scheme of `rng`, the torch build (torch may
    change its sampling algorithm between releases; the secure scheme does not use it,
    but the record keeps one shape), and the history GEMV's order of rounding
    (`cocoon_ckpt.dp.gemv`)."""
    return {
        "scheme": SECURE_SCHEME if as_noise_rng(rng) is NoiseRng.SECURE else GENERATOR_BACKEND,
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

    A different scheme is refused even with `allow_change`: it is another generator (a
    secure job would go on with the default one), not another build of the same one.

    Raises:
        GeneratorMismatchError: the record differs from this process's backend.
    """
    now = generator_backend(rng)
    if recorded.get("scheme") != now["scheme"]:
        raise GeneratorMismatchError(
            f"the store's noise came from generator scheme {recorded.get('scheme')!r}, "
            f"this process would draw it with {now['scheme']!r} (noise_rng={as_noise_rng(rng).value}): "
            "resume with the noise_rng the job started with"
        )
    if recorded != now and not allow_change:
        raise GeneratorMismatchError(
            f"the store's noise came from generator backend {recorded}, this process has "
            f"{now}: resumed noise would differ from an uninterrupted run. Use the same torch "
            "release, or pass allow_generator_change=True to accept the difference"
        )
