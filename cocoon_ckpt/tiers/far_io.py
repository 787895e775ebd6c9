"""The far tier's file: created owner-only, read and written by position in bounded
buffers, and its GEMV streamed through it column chunk by column chunk.

The shard is a (slots, width) row-major file. Nothing here maps it: a mapped file's
touched pages count in the resident set of every process that touched them, so a shard
on disk larger than RAM would have shown up, whole, in the trainer's RSS (its slot
writes) and in the worker's (its GEMV). Positioned reads and writes go through the page
cache, which the kernel gives back under pressure, and each process holds at most
`STREAM_CHUNK_BYTES` (twice, while the next chunk is read) of it at a time.

Imports numpy and `cocoon_ckpt.dp.gemv` only: the far worker process runs it.
"""

from __future__ import annotations

import concurrent.futures
import errno
import os
from typing import Any

import numpy as np

from cocoon_ckpt.dp.gemv import mix_history

__all__ = [
    "STREAM_CHUNK_BYTES",
    "private_file",
    "private_memmap",
    "read_at",
    "read_columns",
    "stream_gemv",
    "write_at",
]

#: Bytes of the shard one GEMV chunk reads (all slots of a column range): large enough
#: that each slot's part is a long sequential read, small enough to stay out of the RSS.
STREAM_CHUNK_BYTES = 32 << 20


def private_file(path: str, nbytes: int) -> int:
    """A new zero-filled (sparse) file `path` of `nbytes`, created 0600 whatever the
    umask; returns a read-write descriptor the caller closes."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.ftruncate(fd, nbytes)
    except BaseException:
        os.close(fd)
        raise
    return fd


def private_memmap(path: str, dtype: Any, shape: tuple[int, ...]) -> Any:
    """A new zero-filled file `path` mapped as an array, created 0600 whatever the umask
    (np.memmap's "w+" creates it 0666 & ~umask: under umask 000 the history was
    readable by everyone for as long as the folder's mode was all that stood between).
    For the small buffers the trainer and the worker share (mixing vector, result)."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    os.close(private_file(path, nbytes))
    return np.memmap(path, dtype=dtype, mode="r+", shape=shape)


def write_at(fd: int, values: np.ndarray, offset: int) -> None:
    """Write the C-contiguous `values` at byte `offset` of `fd`, whole (pwrite may
    write less than asked)."""
    if not values.nbytes:
        return
    view = np.ascontiguousarray(values).data.cast("B")
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def _in_a_hole(fd: int, offset: int, nbytes: int) -> bool:
    """Whether bytes [offset, offset + nbytes) of `fd` are all a hole (never written,
    inside the file): SEEK_DATA finds no data before their end. False where the
    filesystem or platform cannot say (it then reports every byte as data)."""
    seek_data = getattr(os, "SEEK_DATA", None)
    if seek_data is None:
        return False
    try:
        data = os.lseek(fd, offset, seek_data)
    except OSError as exc:
        if exc.errno != errno.ENXIO:  # ENXIO: no data from offset to the end
            return False
        return offset + nbytes <= os.fstat(fd).st_size
    return data >= offset + nbytes


def read_at(fd: int, out: np.ndarray, offset: int) -> None:
    """Fill the C-contiguous `out` from byte `offset` of `fd`.

    A range that is all a hole of the file (slots no step has written yet) is filled
    with zeros, the bytes a read of it returns, without reading: a read of a hole
    makes the kernel fault in a page-cache page of zeros for every 4 KiB. An 85.9M,
    b = 32 job's first steps read 6.65 GB of a new far file's holes that way, each a
    first touch of memory on this VM (the first step took 90-105 s against 5-20 s).

    Raises:
        OSError: the file ends first (it was truncated under us).
    """
    if not out.nbytes:
        return
    if _in_a_hole(fd, offset, out.nbytes):
        out[...] = 0
        return
    view = out.data.cast("B")
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise OSError(f"far tier file ended {len(view) - done} bytes early at {offset + done}")
        done += n


def read_columns(fd: int, out: np.ndarray, width: int, lo: int) -> None:
    """Columns [lo, lo + out.shape[1]) of every slot of a (out.shape[0], width) shard
    into `out` (whose rows may be longer than the range: only its first columns are
    filled). One positioned read per slot."""
    slots, cols = out.shape[0], out.shape[1]
    item = out.dtype.itemsize
    for s in range(slots):
        read_at(fd, out[s, :cols], (s * width + lo) * item)


def _column_step(slots: int, itemsize: int, chunk_bytes: int) -> int:
    return max(1, chunk_bytes // max(1, slots * itemsize))


def stream_gemv(
    fd: int,
    mix: np.ndarray,
    slots: int,
    width: int,
    out: np.ndarray,
    *,
    chunk_bytes: int = STREAM_CHUNK_BYTES,
) -> None:
    """out = sum_i mix[i] * shard[i] over the (slots, width) shard in `fd`, column chunk
    by column chunk, the next chunk read while this one is computed.

    Bit for bit `mix_history` over the whole shard: its kernel computes each column on
    its own in one fixed order, so a column split changes nothing.

    Args:
        fd: the shard file, read by position.
        mix: (slots,) mixing vector.
        slots, width: the shard's shape.
        out: (width,) destination in the shard's dtype.
        chunk_bytes: bytes of the shard held per chunk (two chunks at most at once).
    """
    dtype = out.dtype
    if not slots or not width:
        out[...] = 0
        return
    step = _column_step(slots, dtype.itemsize, chunk_bytes)
    cuts = list(range(0, width, step)) + [width]
    bufs = [np.empty((slots, min(step, width)), dtype=dtype) for _ in range(min(2, len(cuts) - 1))]

    def fill(i: int) -> np.ndarray:
        buf = bufs[i % len(bufs)]
        read_columns(fd, buf[:, : cuts[i + 1] - cuts[i]], width, cuts[i])
        return buf

    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as reader:
        nxt = reader.submit(fill, 0)
        for i in range(len(cuts) - 1):
            buf = nxt.result()
            if i + 1 < len(cuts) - 1:
                nxt = reader.submit(fill, i + 1)
            n = cuts[i + 1] - cuts[i]
            mix_history(mix, buf[:, :n], out[cuts[i] : cuts[i + 1]])
