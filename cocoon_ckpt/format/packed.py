"""Small opaque arrays packed into a record instead of written as arrays of their own:
`{"dtype", "shape", "data"}`, `data` the base64 of the array's little-endian C-order
bytes (`records.PackedArrayRecord`).

A version of a small model was ~20 files, five of them the generators' states (two
arrays of a chunk and a zarr.json each, and their folder's zarr.json); on a job that
checkpoints every ~20 ms of training the disk's work per file is what a checkpoint
costs (docs/benchmarks.md, cadence). Inside the manifest they cost no file and are
covered by the record's sha256 and MAC like every record. Only state no zarr client
reads by name is packed: never a model parameter or an optimizer tensor.

Torch-free (`tools.catalog` reads the sizes)."""

from __future__ import annotations

import base64
import binascii
import math
from typing import Any

import numpy as np

from cocoon_ckpt.records import PackedArrayRecord

__all__ = ["MAX_CUDA_STATES", "MAX_PACKED_BYTES", "pack_array", "packed_nbytes", "unpack_array"]

#: The most bytes one packed array may hold (a generator's state is 5 KiB at most:
#: torch's 5,056, numpy's 2,496, a CUDA generator's 16); larger is refused before
#: anything is decoded or allocated.
MAX_PACKED_BYTES = 1 << 16

#: The most CUDA generators' states a version holds (one per device).
MAX_CUDA_STATES = 1024

#: The dtypes a packed array may have (a generator's state is bytes or words).
_DTYPES = ("uint8", "uint32", "uint64", "int64")


def pack_array(a: np.ndarray) -> PackedArrayRecord:
    """The record of a small array `a` (a copy of its bytes: `a` may change after).

    Raises:
        TypeError: `a`'s dtype is not one a generator's state has, or it holds more
            than `MAX_PACKED_BYTES`.
    """
    if a.dtype.name not in _DTYPES:
        raise TypeError(f"cannot pack an array of {a.dtype}: only {', '.join(_DTYPES)}")
    if a.nbytes > MAX_PACKED_BYTES:
        raise TypeError(f"cannot pack {a.nbytes} bytes: at most {MAX_PACKED_BYTES}")
    raw = np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<")).tobytes()
    return {
        "dtype": a.dtype.name,
        "shape": [int(n) for n in a.shape],
        "data": base64.b64encode(raw).decode("ascii"),
    }


def packed_nbytes(rec: Any) -> int:
    """The bytes a packed array holds, from its dtype and shape (nothing decoded).

    Raises:
        ValueError: `rec` is not a packed array's record, or is over the bound.
    """
    if not isinstance(rec, dict) or set(rec) != {"dtype", "shape", "data"}:
        raise ValueError(f"a packed array is {{dtype, shape, data}}, not {str(rec)[:80]}")
    dtype, shape, data = rec["dtype"], rec["shape"], rec["data"]
    if dtype not in _DTYPES:
        raise ValueError(f"a packed array of dtype {dtype!r}: only {', '.join(_DTYPES)}")
    if (
        not isinstance(shape, list)
        or len(shape) > 4
        or not all(type(n) is int and 0 <= n <= MAX_PACKED_BYTES for n in shape)
    ):
        raise ValueError(f"a packed array of shape {str(shape)[:80]}: not up to 4 sizes")
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    if nbytes > MAX_PACKED_BYTES:
        raise ValueError(f"a packed array of {nbytes} bytes: at most {MAX_PACKED_BYTES}")
    if not isinstance(data, str) or len(data) != 4 * math.ceil(nbytes / 3):
        raise ValueError(
            f"a packed array of {dtype} and shape {shape} is {4 * math.ceil(nbytes / 3)} "
            f"base64 characters, the record holds {len(data) if isinstance(data, str) else data!r}"
        )
    return nbytes


def unpack_array(rec: Any) -> np.ndarray:
    """The array `pack_array` recorded (native byte order, writable, its own memory).

    Raises:
        ValueError: `rec` is not a packed array's record: its form, dtype, shape or
            bytes (checked before anything is decoded).
    """
    nbytes = packed_nbytes(rec)
    try:
        raw = base64.b64decode(rec["data"], validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"a packed array's data is not base64 ({exc})") from None
    if len(raw) != nbytes:
        raise ValueError(f"a packed array's data holds {len(raw)} bytes, its shape another count")
    le = np.frombuffer(raw, dtype=np.dtype(rec["dtype"]).newbyteorder("<"))
    return le.astype(np.dtype(rec["dtype"])).reshape(rec["shape"])
