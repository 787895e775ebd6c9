"""Whole-array checksums recorded in manifests (crc32c over the C-order bytes)."""

from __future__ import annotations

import functools

import crc32c
import numpy as np

__all__ = ["array_checksum", "crc32c_combine"]


def array_checksum(array: np.ndarray) -> str:
    """`"crc32c:xxxxxxxx"` of the array's C-contiguous bytes; shape and dtype are
    recorded beside it in the manifest, so they are not folded in here."""
    data = np.asarray(array, order="C")
    raw = data.reshape(-1).view(np.uint8)  # 1-d first: a 0-d array cannot change dtype
    return f"crc32c:{crc32c.crc32c(raw.data):08x}"


# crc32c of a concatenation from the crcs of its parts (zlib's crc32_combine, for the
# Castagnoli polynomial): crc(a + b) = shift(crc(a), len(b)) ^ crc(b), where shifting
# is multiplication by x^(8 len(b)) modulo the polynomial, a linear map on 32 bits.
# A restore crc's each chunk once and combines them into the array's checksum instead
# of running a second crc over every byte.
_POLY = 0x82F63B78  # crc32c, reflected


def _times(matrix: list[int], vector: int) -> int:
    """The 32x32 GF(2) `matrix` (one column a row of the list) times `vector`."""
    out = 0
    row = 0
    while vector:
        if vector & 1:
            out ^= matrix[row]
        vector >>= 1
        row += 1
    return out


def _square(matrix: list[int]) -> list[int]:
    return [_times(matrix, column) for column in matrix]


@functools.cache
def _byte_shifts(count: int) -> list[list[int]]:
    """The linear maps that shift a crc by 2^k zero bytes, k = 0 .. count-1 (11 ms for
    48 once a process, so not at import)."""
    bit = [_POLY] + [1 << n for n in range(31)]  # one zero bit
    byte = _square(_square(_square(bit)))  # eight
    shifts = [byte]
    for _ in range(count - 1):
        shifts.append(_square(shifts[-1]))
    return shifts


def crc32c_combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """crc32c of `a + b` from `crc32c(a)`, `crc32c(b)` and `len(b)` in bytes."""
    shifts = _byte_shifts(48)  # up to 256 TiB
    k = 0
    while len_b:
        if len_b & 1:
            crc_a = _times(shifts[k], crc_a)
        len_b >>= 1
        k += 1
    return crc_a ^ crc_b
