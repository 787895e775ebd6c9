"""How a staged file's bytes reach the disk: large files with O_DIRECT where the
filesystem takes it, else through the page cache paced `PACE_BYTES` at a time, small
files in one go. The bytes written, and the caller's fsync before any commit, are the
same whichever way; only the kernel's work beside the training step differs
(docs/benchmarks.md, "checkpoint stalls")."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import threading
from collections.abc import Callable, Sequence
from typing import cast

import numpy as np

__all__ = ["DIRECT_BYTES", "PACE_BYTES", "write_all", "write_parts"]


def write_parts(fd: int, parts: Sequence[bytes | memoryview]) -> None:
    """`parts` into the empty file `fd` from its start: with O_DIRECT when larger than
    `DIRECT_BYTES` (falling back as `_write_direct` says), else `_write_buffered`."""
    size = sum(memoryview(p).nbytes for p in parts)
    if DIRECT_BYTES and size > DIRECT_BYTES:
        _write_direct(fd, parts, size)
    else:
        _write_buffered(fd, parts, size)


def write_all(fd: int, parts: Sequence[bytes | memoryview]) -> None:
    for part in parts:
        view = memoryview(part)
        while view:
            view = view[os.write(fd, view) :]


#: A staged file larger than this is written this many bytes at a time, each piece's
#: writeback started as soon as it is written; once `_PACE_WINDOW` pieces of the file
#: are under writeback, the oldest are waited for and dropped from the page cache, so
#: the dirty pages of a large version never pile up. 0 writes every file in one go and
#: leaves its writeback to the background fsync. A 1.28 GB version written in one go
#: piles up as dirty page cache that the kernel then writes back beside the training
#: step, filling fresh page cache as it goes (docs/benchmarks.md, "checkpoints at GB
#: scale"). The fsync before the commit is unchanged: pacing only starts the
#: writeback earlier and waits for it in the writer. Files over `DIRECT_BYTES` skip the
#: page cache where the filesystem takes O_DIRECT; pacing is their fallback.
PACE_BYTES = 8 << 20
_PACE_WINDOW = 8  # pieces in flight: enough queue depth to keep the disk busy

_SYNC_FILE_RANGE_WAIT_BEFORE = 1
_SYNC_FILE_RANGE_WRITE = 2
_SYNC_FILE_RANGE_WAIT_AFTER = 4
_WAIT_ALL = _SYNC_FILE_RANGE_WAIT_BEFORE | _SYNC_FILE_RANGE_WRITE | _SYNC_FILE_RANGE_WAIT_AFTER


def _load_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """libc's sync_file_range (Linux), or None where there is none."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return cast("Callable[[int, int, int, int], int]", fn)


_sync_file_range = _load_sync_file_range()


def _sync_range(fd: int, offset: int, nbytes: int, flags: int) -> None:
    """sync_file_range, where libc has it (else nothing: the fsync still comes).

    Raises:
        OSError: it failed (a writeback error, which the fsync would report too).
    """
    if _sync_file_range is not None and _sync_file_range(fd, offset, nbytes, flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _write_paced(
    fd: int, parts: Sequence[bytes | memoryview], pace: int, *, start: int = 0
) -> None:
    """`write_all`, `pace` bytes at a time: each piece's writeback is started once it
    is written; what lies more than `_PACE_WINDOW` pieces behind is waited for and
    dropped from the page cache. Where sync_file_range is missing nothing is waited
    for, and `posix_fadvise(DONTNEED)` starts the writeback instead. `start`: the fd's
    offset, where the parts begin."""
    offset = start
    behind = start  # everything before this offset is written back and dropped
    for part in parts:
        view = memoryview(part).cast("B")
        for lo in range(0, len(view), pace):
            write_all(fd, [view[lo : lo + pace]])
            end = offset + min(pace, len(view) - lo)
            _sync_range(fd, offset, end - offset, _SYNC_FILE_RANGE_WRITE)
            offset = end
            if offset - behind > _PACE_WINDOW * pace:
                upto = offset - _PACE_WINDOW * pace
                _sync_range(fd, behind, upto - behind, _WAIT_ALL)
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(fd, behind, upto - behind, os.POSIX_FADV_DONTNEED)
                behind = upto


def _write_buffered(
    fd: int, parts: Sequence[bytes | memoryview], size: int, start: int = 0
) -> None:
    """`parts` (`size` bytes) through the page cache at the fd's offset `start`: paced
    when larger than `PACE_BYTES`, else in one go."""
    if PACE_BYTES and size > PACE_BYTES:
        _write_paced(fd, parts, PACE_BYTES, start=start)
    else:
        write_all(fd, parts)


#: A staged file larger than this is written with O_DIRECT, from a page-aligned bounce
#: buffer of `_DIRECT_PIECE` bytes that each writing thread keeps, where the filesystem
#: takes it (else, and after any write it refuses, through the page cache: paced).
#: 0 writes every file through the page cache. Measured reason (docs/benchmarks.md,
#: "checkpoint stalls"): through the page cache the writer's CPU in the step beside it
#: was mostly kernel time, allocating page cache (on this VM from memory handed back to
#: the host: free page reporting), copying into it, and writing it back from kworkers,
#: all on the 2 cores the training step needs; a direct write copies once into memory
#: it reuses and the disk reads it by DMA. In the step beside an 8M job's 160 MB
#: version, writer at nice 10, the writer's CPU (its fsyncs included) fell from 150-590
#: ms (medians, paced) to 60-85 ms, the machine's system time from 700-1,235 to
#: 435-1,000 ms (5 runs, each with both writers in turns).
#: The bytes on disk and the fsync of every file before the manifest are the same; the
#: padding past a file's end is zeros, cut off (no other file's bytes reach the disk).
DIRECT_BYTES = 8 << 20
_DIRECT_ALIGN = 4096  # offsets, lengths and addresses: a multiple of any block size here
_DIRECT_PIECE = 4 << 20
_bounce = threading.local()


class _Refused(Exception):
    """A direct write refused (EINVAL) or cut short at `done` bytes of the file."""

    def __init__(self, done: int) -> None:
        super().__init__(done)
        self.done = done


def _bounce_buffer() -> mmap.mmap:
    """This thread's aligned bounce buffer (an anonymous map: page-aligned), kept."""
    buf: mmap.mmap | None = getattr(_bounce, "buf", None)
    if buf is None or len(buf) != _DIRECT_PIECE:
        buf = _bounce.buf = mmap.mmap(-1, _DIRECT_PIECE)
    return buf


def _set_direct(fd: int, on: bool) -> bool:
    """Turn O_DIRECT on or off for `fd`; False where the filesystem refuses it."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    want = flags | os.O_DIRECT if on else flags & ~os.O_DIRECT
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, want)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        return False
    return True


def _pwrite_direct(fd: int, view: memoryview, at: int, real: int) -> None:
    """Write aligned `view` at `at`, of which the first `real` bytes are the file's.

    Raises:
        _Refused: EINVAL, or a short write (the fallback rewrites from what is known
            written).
    """
    try:
        n = os.pwrite(fd, view, at)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        raise _Refused(at) from None
    if n < len(view):
        raise _Refused(at + min(n, real))


def _write_direct(fd: int, parts: Sequence[bytes | memoryview], size: int) -> None:
    """`parts` (`size` bytes) from the start of the empty file `fd` with O_DIRECT:
    whole pieces of the bounce buffer, the last padded with zeros to the alignment and
    the file then cut to `size`. Where O_DIRECT is refused, at the open or at any write,
    the rest goes through the page cache (`_write_buffered`) from where it stopped."""
    if not hasattr(os, "O_DIRECT") or not _set_direct(fd, True):
        _write_buffered(fd, parts, size)
        return
    buf = _bounce_buffer()
    # numpy's copy releases the GIL (an mmap slice assignment holds it for the memcpy)
    into = np.frombuffer(buf, dtype=np.uint8)
    fill = at = 0  # bytes in the buffer; the file offset of its first byte
    try:
        for part in parts:
            src = np.frombuffer(memoryview(part).cast("B"), dtype=np.uint8)
            while len(src):
                take = min(len(src), _DIRECT_PIECE - fill)
                into[fill : fill + take] = src[:take]
                fill += take
                src = src[take:]
                if fill == _DIRECT_PIECE:
                    _pwrite_direct(fd, memoryview(buf), at, fill)
                    at += fill
                    fill = 0
        if fill:
            padded = -(-fill // _DIRECT_ALIGN) * _DIRECT_ALIGN
            into[fill:padded] = 0
            _pwrite_direct(fd, memoryview(buf)[:padded], at, fill)
            os.ftruncate(fd, size)
    except _Refused as refused:
        _set_direct(fd, False)
        os.lseek(fd, refused.done, os.SEEK_SET)
        _write_buffered(fd, _skip(parts, refused.done), size - refused.done, refused.done)
        os.ftruncate(fd, size)  # a refused tail may have left padding past the end


def _skip(parts: Sequence[bytes | memoryview], nbytes: int) -> list[memoryview]:
    """`parts` less their first `nbytes` bytes."""
    out = []
    for part in parts:
        view = memoryview(part).cast("B")
        if nbytes >= len(view):
            nbytes -= len(view)
            continue
        out.append(view[nbytes:])
        nbytes = 0
    return out
