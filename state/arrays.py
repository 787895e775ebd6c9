"""Array I/O in zarr v3 format: crc32c on every chunk, every chunk written.

Arrays are written by zarr's metadata code and a direct chunk path: each chunk is the
C-order bytes (little endian) followed by their crc32c, which is exactly what zarr's
`bytes` + `crc32c` codec pipeline produces, so any zarr v3 client reads them. The
direct path exists for speed: it fills each chunk in one copy and computes the chunk
crc and the whole-array checksum in the same pass over cache-sized pieces (the first
chunk's crc is the array's so far, so one crc serves both), where zarr's pipeline
copies each chunk several times. Files go through `Backend.write_staged`: local disk
starts each file's fsync as soon as it is written. Arrays whose metadata is anything
else are read through zarr itself.
"""

from __future__ import annotations

import functools
import json
import math
import os
import stat
from collections.abc import Callable, Sequence
from typing import Any

import crc32c
import numpy as np
import zarr

from .backend import Backend
from .checksum import array_checksum, crc32c_combine
from .manifest import ArrayMeta

__all__ = [
    "CHUNK_BYTES",
    "CHUNK_SEPARATOR",
    "ZARR_DATA_TYPES",
    "array_metadata",
    "chunk_key",
    "core_dtype",
    "default_dimension_names",
    "read_array",
    "verify_array",
    "write_array",
    "written_meta",
]

#: Target chunk size. Large enough that per-chunk overhead vanishes against the bytes,
#: small enough that a damaged chunk names a small region.
CHUNK_BYTES = 16 << 20
#: crc pieces: small enough to stay in cache for the second crc. A restore read in 256
#: KiB pieces (each in the core's 2 MiB L2 for its crc) took 1.04x the time of 1 MiB
#: ones and 1.02x the CPU at 42M (10 alternating rounds, its read pool on 2 cores).
_PIECE = 1 << 20

#: The chunk key separator of the arrays written now: `c.0.0` beside zarr.json, where
#: "/" (`c/0/0`, what stores of format 2 hold and is still read) makes a folder for
#: every axis. A checkpoint every 10 steps of a small model writes a version every
#: ~20 ms, and each folder is a mkdir, a chmod, an fsync and, at retention, an open, a
#: scan and an rmdir: the two folders of a matrix's chunk were 10 of a digits version's
#: 40 entries, and ~5 of its 26 ms (docs/benchmarks.md).
CHUNK_SEPARATOR = "."
_SEPARATORS = ("/", ".")


def _chunks(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    if not shape:
        return ()
    row = itemsize
    for s in shape[1:]:
        row *= max(s, 1)
    lead = max(1, min(shape[0], CHUNK_BYTES // max(row, 1)))
    return (lead, *[max(s, 1) for s in shape[1:]])


def _expected_codecs(dtype: np.dtype[Any]) -> list[dict[str, Any]]:
    bytes_codec: dict[str, Any] = {"name": "bytes"}
    if dtype.itemsize > 1:
        bytes_codec["configuration"] = {"endian": "little"}
    return [bytes_codec, {"name": "crc32c"}]


def chunk_key(index: int, ndim: int, separator: str) -> str:
    """The key of chunk `index` along axis 0 of an `ndim`-d array of this module's grid
    (`c` for a 0-d array)."""
    if ndim == 0:
        return "c"
    return "c" + separator + separator.join([str(index)] + ["0"] * (ndim - 1))


def _layout(shape: tuple[int, ...], chunks: tuple[int, ...]) -> tuple[int, int]:
    """(number of chunks, rows per chunk) for a grid that splits only axis 0."""
    if not shape:
        return 1, 1
    if any(s == 0 for s in shape):
        return 0, chunks[0]
    return math.ceil(shape[0] / chunks[0]), chunks[0]


def _crc_pair(view: memoryview, array_crc: int) -> tuple[int, int]:
    """(crc of `view` alone, `array_crc` extended by `view`) in one pass over memory."""
    chunk_crc = 0
    for lo in range(0, len(view), _PIECE):
        piece = view[lo : lo + _PIECE]
        chunk_crc = crc32c.crc32c(piece, chunk_crc)
        array_crc = crc32c.crc32c(piece, array_crc)  # the piece is cache-hot by now
    return chunk_crc, array_crc


def _rows(arr: np.ndarray) -> np.ndarray:
    """The array as (rows along axis 0, everything else); a 0-d array is one row."""
    return arr.reshape(1, 1) if arr.ndim == 0 else arr.reshape(arr.shape[0], -1)


#: The zarr v3 core data types, by numpy name: the dtypes this module writes.
ZARR_DATA_TYPES = frozenset(
    ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]
    + ["float16", "float32", "float64", "complex64", "complex128"]
)


def default_dimension_names(name: str, ndim: int) -> list[str]:
    """`<leaf>:<axis>` for each axis of array `name` (leaf: its last path component).

    xarray opens a zarr group only when every array names its dimensions, and refuses
    a group where one name has two sizes: `dim_0` for every array would make the 64
    of a weight and the 4 of a bias collide. Names unique to each array never do, and
    `:` is outside the characters of an array name, so a dimension never takes the
    name of a neighbouring array (which xarray would read as a coordinate).
    """
    leaf = name.rsplit("/", 1)[-1]
    return [f"{leaf}:{axis}" for axis in range(ndim)]


def _fill_value(dtype: np.dtype[Any]) -> Any:
    """Zero as zarr v3 spells it for `dtype`: a complex fill is a [real, imag] pair."""
    if dtype.kind == "b":
        return False
    if dtype.kind == "c":
        return [0.0, 0.0]
    return 0.0 if dtype.kind == "f" else 0


def array_metadata(
    shape: tuple[int, ...],
    dtype: np.dtype[Any],
    chunks: tuple[int, ...],
    dimension_names: list[str],
) -> dict[str, Any]:
    """The zarr v3 array metadata (zarr.json) of an array this module writes."""
    return {
        "shape": list(shape),
        "data_type": dtype.name,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunks)}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": CHUNK_SEPARATOR}},
        "fill_value": _fill_value(dtype),
        "codecs": _expected_codecs(dtype),
        "attributes": {},
        "dimension_names": list(dimension_names),
        "zarr_format": 3,
        "node_type": "array",
        "storage_transformers": [],
    }


_GROUP = json.dumps({"attributes": {}, "zarr_format": 3, "node_type": "group"}).encode()


def ensure_groups(backend: Backend, group: str, name: str, done: set[str]) -> None:
    """Write the zarr group metadata of `group` and every folder above `name` in it,
    once each (`done` remembers what this writer already wrote)."""
    parts = name.split("/")[:-1]
    for depth in range(len(parts) + 1):
        rel = "/".join([group, *parts[:depth]])
        if rel not in done:
            backend.write_staged(f"{rel}/zarr.json", [_GROUP], exclusive=False)
            done.add(rel)


def write_array(
    backend: Backend,
    group: str,
    name: str,
    array: np.ndarray,
    *,
    dimension_names: Sequence[str] | None = None,
) -> tuple[str, tuple[int, ...]]:
    """Write `array` as the new zarr array `<group>/<name>` (fails if it exists).

    Every chunk is stored, the fill-value ones too (zarr's `write_empty_chunks=True`):
    zarr by default stores no chunk equal to the fill value, so a lost chunk would read
    back silently as zeros; here a missing chunk is an error.

    The parent groups' metadata is the caller's (`ensure_groups`).

    Args:
        dimension_names: one name per axis for zarr.json (xarray needs them); default
            `default_dimension_names(name, ndim)`.

    Returns:
        The `crc32c:` checksum of the whole array's C-order bytes, and the chunk shape.
        Its chunk keys use `CHUNK_SEPARATOR`.

    Raises:
        TypeError: the dtype is not a zarr v3 core data type (nothing is written).
        ValueError: `dimension_names` does not hold one string per axis (nothing is
            written).
    """
    arr = np.asarray(array, order="C")
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    if arr.dtype.name not in ZARR_DATA_TYPES:
        raise TypeError(
            f"array {group}/{name}: dtype {arr.dtype} is not a zarr v3 data type; "
            f"convert it to one of {', '.join(sorted(ZARR_DATA_TYPES))}"
        )
    if dimension_names is None:
        names = default_dimension_names(name, arr.ndim)
    else:
        names = list(dimension_names)
        if len(names) != arr.ndim or not all(isinstance(n, str) for n in names):
            raise ValueError(
                f"array {group}/{name}: dimension_names={names!r} must hold one string "
                f"per axis of its shape {arr.shape}"
            )
    chunks = _chunks(arr.shape, arr.dtype.itemsize)
    meta = array_metadata(arr.shape, arr.dtype, chunks, names)
    backend.write_staged(f"{group}/{name}/zarr.json", [json.dumps(meta).encode()], exclusive=True)
    n_chunks, rows = _layout(arr.shape, chunks)
    array_crc = 0
    if n_chunks == 0:
        return f"crc32c:{array_crc:08x}", chunks
    flat = _rows(arr)
    row_bytes = flat.shape[1] * arr.dtype.itemsize
    for i in range(n_chunks):
        lo, hi = i * rows, min((i + 1) * rows, flat.shape[0])
        payload = flat[lo:hi].data.cast("B")
        if i == 0:  # the array's crc so far is the first chunk's: one pass, not two
            chunk_crc = array_crc = crc32c.crc32c(payload)
        else:
            chunk_crc, array_crc = _crc_pair(payload, array_crc)
        pad = (rows - (hi - lo)) * row_bytes if arr.ndim else 0
        if pad:  # zarr stores edge chunks at full chunk shape, padded with the fill value
            chunk_crc = crc32c.crc32c(bytes(pad), chunk_crc)
        parts: list[bytes | memoryview] = [payload, bytes(pad), chunk_crc.to_bytes(4, "little")]
        key = chunk_key(i, arr.ndim, CHUNK_SEPARATOR)
        backend.write_staged(f"{group}/{name}/{key}", parts, exclusive=True)
    return f"crc32c:{array_crc:08x}", chunks


def written_meta(path: str, array: np.ndarray, checksum: str, chunks: tuple[int, ...]) -> ArrayMeta:
    """What a manifest records of `array`, written by `write_array` at store path `path`
    (its checksum and chunk shape as returned): its layout, and the chunk key separator
    this module writes."""
    return ArrayMeta(
        path=path,
        shape=tuple(array.shape),
        dtype=str(array.dtype),
        checksum=checksum,
        chunks=chunks,
        separator=CHUNK_SEPARATOR,
    )


def read_array(
    backend: Backend,
    group: str,
    name: str,
    layout: tuple[tuple[int, ...], str, tuple[int, ...]] | None = None,
    separator: str = "/",
    out: np.ndarray | None = None,
) -> tuple[np.ndarray, str]:
    """Read array `<group>/<name>`, checking every chunk's crc32c.

    Args:
        layout: (shape, dtype, chunks) as the manifest recorded them; then zarr.json is
            not read (the manifest is the source of truth, and a cold read saves a
            small random read per array).
        separator: the chunk key separator the manifest recorded, with `layout` (without
            it, zarr.json's).
        out: a C-contiguous array of `layout`'s shape and dtype to read into (with
            `layout` only), instead of one allocated here. `Version.verify` reads on a
            thread pool and allocates on its own thread: glibc serves a pool thread's
            large allocation from a fresh mapping (its arena's heaps hold 64 MiB at
            most), so memory the process freed and malloc kept was never reused and
            every page of a restore faulted in again (docs/benchmarks.md).

    Returns:
        The array (`out` if given) and the `crc32c:` checksum of its C-order bytes.

    Raises:
        FileNotFoundError: the array or one of its chunks is missing.
        ValueError: a chunk is torn or fails its crc32c; `out` is given without
            `layout`, or does not match it.
    """
    if out is not None and (
        layout is None
        or tuple(out.shape) != tuple(layout[0])
        or out.dtype != np.dtype(layout[1])
        or not out.flags.c_contiguous
        or not out.flags.writeable
    ):
        raise ValueError(
            f"array {group}/{name}: out must be a writeable C-contiguous array of the "
            f"layout's shape and dtype, given with it; got {out.dtype}{list(out.shape)} "
            f"for layout {layout!r}"
        )
    direct = _direct_layout(backend, group, name, layout, separator)
    if direct is None:
        if backend.local:  # zarr opens its chunks plainly: a FIFO among them would block
            _refuse_special_files(backend.path(f"{group}/{name}"), f"{group}/{name}")
        out = np.asarray(zarr.open_array(backend.zarr_store(group), path=name, mode="r")[...])
        return out, array_checksum(out)
    shape, dtype, chunks, separator = direct
    if out is None:
        out = np.empty(shape, dtype=dtype)
    array_crc = _scan(backend, f"{group}/{name}", shape, dtype, chunks, separator, out, None)
    return out, f"crc32c:{array_crc:08x}"


def verify_array(
    backend: Backend,
    group: str,
    name: str,
    layout: tuple[tuple[int, ...], str, tuple[int, ...]] | None = None,
    separator: str = "/",
    seen: Callable[[int, memoryview], None] | None = None,
) -> str | None:
    """`read_array`'s checks without the array: every chunk's crc32c, and the checksum
    of the C-order bytes returned, streamed `_PIECE` bytes at a time through one
    scratch buffer, so checking an array larger than memory holds no more than a piece
    of it (a remote backend's read holds one chunk).

    Args:
        layout, separator: as `read_array`'s.
        seen: called with (byte offset in the array, the bytes there) for each piece of
            the array's bytes in order, once each (the bytes are valid only during the
            call); a piece of a chunk whose crc32c fails later has been seen already.

    Returns:
        The `crc32c:` checksum of the array's C-order bytes, or None for an array not in
        this module's chunk layout (zarr reads it: read it whole with `read_array`).

    Raises:
        FileNotFoundError: the array or one of its chunks is missing.
        ValueError: a chunk is torn or fails its crc32c.
    """
    direct = _direct_layout(backend, group, name, layout, separator)
    if direct is None:
        return None
    shape, dtype, chunks, separator = direct
    array_crc = _scan(backend, f"{group}/{name}", shape, dtype, chunks, separator, None, seen)
    return f"crc32c:{array_crc:08x}"


def _direct_layout(
    backend: Backend,
    group: str,
    name: str,
    layout: tuple[tuple[int, ...], str, tuple[int, ...]] | None,
    separator: str,
) -> tuple[tuple[int, ...], np.dtype[Any], tuple[int, ...], str] | None:
    """(shape, dtype, chunks, separator) of an array this module's direct path reads,
    or None for one zarr must read (other codecs, another chunk grid).

    The direct path reads raw bytes into the array, which for an `object` array would
    be pointers: only the zarr v3 core data types (`ZARR_DATA_TYPES`, spelled as this
    module writes them) are read by it; zarr.json naming another goes to zarr, which
    decodes what it knows and refuses the rest.

    Raises:
        ValueError: `layout` names a dtype that is not a core data type.
    """
    if layout is not None:
        dtype = core_dtype(layout[1])
        if dtype is None:
            raise ValueError(
                f"array {group}/{name}: dtype {layout[1]!r} is not a zarr v3 core data "
                f"type ({', '.join(sorted(ZARR_DATA_TYPES))}): its metadata is damaged"
            )
        return layout[0], dtype, layout[2], separator
    meta = json.loads(backend.read_bytes(f"{group}/{name}/zarr.json"))
    dtype = core_dtype(meta["data_type"])
    if dtype is None:
        return None
    shape = tuple(int(s) for s in meta["shape"])
    chunks = tuple(int(c) for c in meta["chunk_grid"]["configuration"]["chunk_shape"])
    encoding = meta.get("chunk_key_encoding")
    config = encoding.get("configuration") if isinstance(encoding, dict) else None
    stored = config.get("separator") if isinstance(config, dict) else None
    direct = (
        meta.get("codecs") == _expected_codecs(dtype)
        and encoding == {"name": "default", "configuration": {"separator": stored}}
        and stored in _SEPARATORS
        and tuple(chunks[1:]) == tuple(max(s, 1) for s in shape[1:])
    )
    return (shape, dtype, chunks, str(stored)) if direct else None


def core_dtype(spelled: object) -> np.dtype[Any] | None:
    """The numpy dtype of a zarr v3 core data type spelled as this module writes it
    (`float32`, the name in a manifest and in zarr.json), or None for anything else."""
    try:
        dtype = np.dtype(str(spelled))
    except (TypeError, ValueError, SyntaxError):  # what numpy raises for a bad spelling
        return None
    return dtype if dtype.name in ZARR_DATA_TYPES and dtype.name == spelled else None


def _scan(
    backend: Backend,
    rel: str,
    shape: tuple[int, ...],
    dtype: np.dtype[Any],
    chunks: tuple[int, ...],
    separator: str,
    out: np.ndarray | None,
    seen: Callable[[int, memoryview], None] | None,
) -> int:
    """Read and check every chunk of array `rel` in order, into `out` (None: through a
    scratch piece), each chunk's crc32c against its trailer.

    Returns:
        The crc32c of the array's C-order bytes.

    Raises:
        FileNotFoundError: a chunk is missing.
        ValueError: a chunk is torn or fails its crc32c.
    """
    n_chunks, rows = _layout(shape, chunks)
    array_crc = 0
    if n_chunks == 0:
        return array_crc
    n_rows = 1 if not shape else shape[0]
    row_bytes = dtype.itemsize * (math.prod(shape[1:]) if shape else 1)
    flat = None if out is None else _rows(out)
    for i in range(n_chunks):
        lo, hi = i * rows, min((i + 1) * rows, n_rows)
        key = chunk_key(i, len(shape), separator)
        size = (hi - lo) * row_bytes
        target = None if flat is None else flat[lo:hi].data.cast("B")
        stored_len = rows * row_bytes if shape else dtype.itemsize
        base = lo * row_bytes
        payload_crc, chunk_crc, trailer = _read_chunk(
            backend,
            f"{rel}/{key}",
            size,
            stored_len,
            target,
            None if seen is None else functools.partial(_at, seen, base),
        )
        # one crc pass over the bytes serves both checks: the array's checksum is the
        # chunks' crcs combined
        array_crc = payload_crc if i == 0 else crc32c_combine(array_crc, payload_crc, size)
        if chunk_crc != int.from_bytes(trailer, "little"):
            raise ValueError(f"chunk {rel}/{key} fails its crc32c: it is damaged")
    return array_crc


def _at(seen: Callable[[int, memoryview], None], base: int, offset: int, piece: memoryview) -> None:
    seen(base + offset, piece)


def _refuse_special_files(top: str, rel: str) -> None:
    """Refuse an array folder holding anything but regular files and folders (a FIFO,
    a device, a socket, through a link or not), before zarr opens its chunks.

    Raises:
        ValueError: naming the file.
    """
    for folder, _dirs, files in os.walk(top):
        for name in files:
            try:
                mode = os.stat(os.path.join(folder, name)).st_mode
            except OSError:
                continue  # a broken link or a file gone: zarr reports it missing
            if not stat.S_ISREG(mode):
                sub = os.path.relpath(os.path.join(folder, name), top)
                raise ValueError(f"{rel}/{sub} is not a regular file: it is damaged")


def _read_chunk(
    backend: Backend,
    rel: str,
    size: int,
    stored_len: int,
    target: memoryview | None = None,
    seen: Callable[[int, memoryview], None] | None = None,
) -> tuple[int, int, bytes]:
    """Read the chunk's leading `size` bytes into `target` (None: through one scratch
    piece, kept nowhere), crc32c'd as they arrive, each piece handed to `seen`.

    Returns (crc32c of those bytes, crc32c of the whole stored payload with its
    padding, the crc trailer).

    On local disk the chunk is read `_PIECE` bytes at a time, each piece crc'd while it
    is still in cache: a whole 168 MB chunk (a ring row of a 42M model) read at once,
    then crc'd twice (chunk and array) from memory ran a restore at 0.5 of np.load's
    (docs/benchmarks.md). The padding of an edge chunk is read the same way, through a
    scratch piece.
    """
    want = stored_len + 4
    if not backend.local:
        raw = memoryview(backend.read_bytes(rel))
        if len(raw) != want:
            raise ValueError(f"chunk {rel} is {len(raw)} bytes, expected {want}: it is torn")
        if target is not None:
            target[:] = raw[:size]
        crc = 0
        for lo in range(0, size, _PIECE):
            piece = raw[lo : min(lo + _PIECE, size)]
            crc = crc32c.crc32c(piece, crc)
            if seen is not None:
                seen(lo, piece)
        return crc, crc32c.crc32c(raw[size:-4], crc), bytes(raw[-4:])
    fd = os.open(backend.path(rel), os.O_RDONLY | os.O_NONBLOCK)  # a FIFO must not hang
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"chunk {rel} is not a regular file: it is damaged")
        if st.st_size != want:
            raise ValueError(f"chunk {rel} is {st.st_size} bytes, expected {want}: it is torn")
        pad = stored_len - size
        # the pieces kept nowhere: the payload's when there is no target, the padding's
        scratch = memoryview(bytearray(min(_PIECE, max(size if target is None else 0, pad, 1))))
        crc = 0
        for lo in range(0, size, _PIECE):
            end = min(lo + _PIECE, size)
            piece = target[lo:end] if target is not None else scratch[: end - lo]
            _fill(fd, piece, rel)
            crc = crc32c.crc32c(piece, crc)
            if seen is not None:
                seen(lo, piece)
        chunk_crc = crc
        for lo in range(0, pad, _PIECE):
            piece = scratch[: min(_PIECE, pad - lo)]
            _fill(fd, piece, rel)
            chunk_crc = crc32c.crc32c(piece, chunk_crc)
        trailer = os.read(fd, 5)  # one byte more: a file grown since
    finally:
        os.close(fd)
    if len(trailer) != 4:
        raise ValueError(
            f"chunk {rel} is {stored_len + len(trailer)} bytes, expected {want}: it is torn"
        )
    return crc, chunk_crc, trailer


def _fill(fd: int, piece: memoryview, rel: str) -> None:
    """Fill `piece` from `fd`'s position.

    Raises:
        ValueError: the file ends first (it is torn).
    """
    filled = 0
    while filled < len(piece):
        got = os.readv(fd, [piece[filled:]])
        if got == 0:
            raise ValueError(f"chunk {rel} is short: it is torn")
        filled += got
