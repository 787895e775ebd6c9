"""Array I/O through zarr v3: crc32c on every chunk, every chunk written (no fill elision)."""

from __future__ import annotations

from typing import Any

import numpy as np
import zarr
from zarr.codecs import Crc32cCodec

__all__ = ["CHUNK_BYTES", "read_array", "write_array"]

#: Target chunk size. Large enough that per-chunk overhead vanishes against the bytes,
#: small enough that a damaged chunk names a small region.
CHUNK_BYTES = 16 << 20


def _chunks(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    if not shape:
        return ()
    row = itemsize
    for s in shape[1:]:
        row *= max(s, 1)
    lead = max(1, min(shape[0], CHUNK_BYTES // max(row, 1)))
    return (lead, *[max(s, 1) for s in shape[1:]])


def write_array(store: Any, name: str, array: np.ndarray) -> None:
    """Write `array` as a new zarr array `name` in `store` (fails if it exists).

    `write_empty_chunks=True`: zarr by default stores no chunk that equals the fill
    value, so a lost chunk would read back silently as zeros; with every chunk stored,
    a missing one is a detectable error.
    """
    arr = np.asarray(array, order="C")
    zarr.create_array(
        store,
        name=name,
        data=arr,
        chunks=_chunks(arr.shape, arr.dtype.itemsize),
        filters=None,
        compressors=[Crc32cCodec()],
        fill_value=0,
        config={"write_empty_chunks": True},
        overwrite=False,
    )


def read_array(store: Any, name: str) -> np.ndarray:
    """Read array `name`; a chunk whose crc32c does not match raises."""
    z = zarr.open_array(store, path=name, mode="r")
    out = z[...]
    return np.asarray(out)
