"""Whole-array checksums recorded in manifests (crc32c over the C-order bytes)."""

from __future__ import annotations

import crc32c
import numpy as np

__all__ = ["array_checksum"]


def array_checksum(array: np.ndarray) -> str:
    """`"crc32c:xxxxxxxx"` of the array's C-contiguous bytes; shape and dtype are
    recorded beside it in the manifest, so they are not folded in here."""
    data = np.asarray(array, order="C")
    raw = data.reshape(-1).view(np.uint8)  # 1-d first: a 0-d array cannot change dtype
    return f"crc32c:{crc32c.crc32c(raw.data):08x}"
