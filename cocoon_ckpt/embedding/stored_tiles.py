"""The precompute's finished tiles, kept in the store as it goes, so a precompute
stopped by a crash, a preemption or a lost node resumes instead of starting over.

Each computed tile's entries are written as two write-once shared arrays (crc32c per
chunk, fsynced once per tile; (column, row) pairs and values) and then a write-once
done-marker naming their checksums:

    shared/precompute/<param>/<digest>/tile-<i>/{index,values}
    shared/precompute/<param>/<digest>/tile-<i>.done

`digest` covers everything that determines a tile's entries (`tile_digest`): the key's
id, the job's fingerprint, the table's plan and shape, the mechanism, the learning
rates, the schedule and the tiling. A resume with anything else finds no tiles of its
own and computes them all. A tile is trusted only when its marker is whole (its own
sha256), names this digest, tile and slots, and every array reads back with the
marker's checksum; anything else is logged, deleted and computed again. Writes happen
under the writer lease, checked before each tile: a writer that was taken over stops.
A job's tiles are written by one `TileWriter` thread, in the order they finish, while
the next tiles compute.

On several ranks (`embedding.csc_shards`) each rank computes its own run of the tiles
and keeps them in a folder of its own, without the writer lease (which only rank 0
holds), as a rank writes its ring shard:

    shared/precompute/<param>/<digest>/g<gen>-r<rank>/tile-<i>{/index,/values,.done}

`i` is the tile's index among the table's tiles, which no world size changes, and `gen`
rank 0's lease generation: a rank keeps a tile only while no newer generation exists
(asked of the storage before each tile), so a superseded job's ranks stop, and a rank
of a new job never writes into an old one's folder. A tile is looked for in this rank's
folder, then one process's, then every other rank folder of the digest: the marker,
the checksums and the MACs decide whether it is trusted, wherever it lies, so a
precompute killed on some number of ranks resumes on any number (one process included)
and computes only the tiles none of them kept.

The parts are the precompute's scratch, not the CSC: the first version writes the
assembled CSC (`CoalescedCSC`, as before) and references it, and once a committed
version does, `drop_tile_parts` deletes them. Retention never deletes anything under
shared/, so the parts of a precompute in progress are safe from it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from cocoon_ckpt.embedding.precompute import TileEntries, TileLayout
from cocoon_ckpt.layout import emb_name
from state import ArrayMeta, FencedError, Manifest, Store, hooks
from state.arrays import ensure_groups, read_array, write_array, written_meta
from state.canonical_json import load_bounded
from state.paths import SHARED, lease_path, shared_path

__all__ = ["PRECOMPUTE", "TILE_KEPT", "StoredTiles", "TileWriter", "drop_tile_parts", "tile_digest"]

log = logging.getLogger(__name__)

#: Under shared/: every table's precompute parts.
PRECOMPUTE = "precompute"

TILE_KEPT = hooks.declare(
    "precompute.tile_kept",
    "a precompute tile's arrays and done-marker durable in the store; step = tiles kept "
    "so far by this writer (every table's), tile = its index",
)

#: A tile's arrays: (E, 2) int64 (column, row) of each entry, and (E, dim) values.
_ARRAYS = ("index", "values")
_MARKER = "cocoon-ckpt precompute tile"

#: A rank's folder of kept tiles under a table's digest: `g<gen>-r<rank:04d>`.
_RANK_FOLDER = re.compile(r"g(\d+)-r(\d{4,})")

#: A done-marker is a few hundred bytes; a larger file there is not read (I7).
_MARKER_MAX_BYTES = 64 << 10


def tile_digest(fields: dict[str, Any], arrays: dict[str, np.ndarray]) -> str:
    """sha256 (hex, 32 characters) over `fields` (canonical JSON) and the bytes, dtype
    and shape of each of `arrays`, in name order."""
    h = hashlib.sha256(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode())
    for name in sorted(arrays):
        arr = np.ascontiguousarray(arrays[name])
        h.update(f"|{name}:{arr.dtype.str}:{arr.shape}|".encode())
        h.update(arr.data.cast("B"))
    return h.hexdigest()[:32]


class TileWriter:
    """One background thread that keeps tiles (`StoredTiles.save` hands them over), so
    the writes and fsyncs overlap the tiles still computing, those of the next table
    included, instead of holding up the precompute's calling thread.

    The first error (a fenced writer, a storage error, a crash point) stops it: tiles
    handed over later are dropped, `check` raises it at the next hand-over and `close`
    at the end. Use it as a context manager around the precompute.
    """

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="cocoon-tiles")
        self._futures: list[Future[None]] = []
        self._failed = threading.Event()
        self.kept = 0

    def submit(self, write: Callable[[], None]) -> None:
        """Run `write` after the tiles handed over before (none once one failed)."""
        self.check()

        def run() -> None:
            if self._failed.is_set():
                return
            try:
                write()
                self.kept += 1
                hooks.point(TILE_KEPT, step=self.kept)
            except BaseException:
                self._failed.set()
                raise

        self._futures.append(self._pool.submit(run))

    def check(self) -> None:
        """Raise the first failure of a finished write, if any."""
        if self._failed.is_set():
            self._raise_first()

    def _raise_first(self) -> None:
        for fut in self._futures:
            if fut.done() and fut.exception() is not None:
                raise fut.exception()  # type: ignore[misc]

    def close(self) -> None:
        """Wait for every tile handed over to be kept; raise the first failure."""
        self._pool.shutdown(wait=True)
        self._raise_first()

    def __enter__(self) -> TileWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.close()
        else:  # the precompute failed: keep what was handed over, raise its error
            self._pool.shutdown(wait=True)


class StoredTiles:
    """`TileParts` of one table kept in `store` (which must hold the writer lease).

    Args:
        store: the job's store.
        param: the table's parameter name.
        digest: `tile_digest` of everything that determines the table's entries.
        writer: keep tiles on this background writer (None: in `save`'s caller).
        rank: (generation, rank) of a rank of a job on several ranks: its tiles go into
            its own folder, fenced by rank 0's lease `generation`, not by a lease of
            its own (None: one process, under the store's lease).

    Attributes:
        loaded, computed: tiles found in the store and tiles written by this run.
        write_seconds: time spent keeping tiles (in the caller's thread, while the
            precompute's workers compute the next tiles).
    """

    def __init__(
        self,
        store: Store,
        param: str,
        digest: str,
        writer: TileWriter | None = None,
        *,
        mac_key: bytes,
        rank: tuple[int, int] | None = None,
    ) -> None:
        self.store = store
        # A writer of the store without the job's key could otherwise write a tile and
        # re-stamp its crc32c and the marker's sha256: the CSC built from it would be
        # sealed by the next commit. The marker and each array's bytes carry keyed
        # BLAKE2b MACs under a key derived from the noise key (`keys.tile_mac_key`).
        self.mac_key = mac_key
        self.writer = writer
        self.param = param
        self.digest = digest
        self.folder = f"{PRECOMPUTE}/{param}/{digest}"
        self.rank = rank
        #: where this writer keeps its tiles: the digest's folder, or its rank folder
        self.own = self.folder if rank is None else f"{self.folder}/g{rank[0]}-r{rank[1]:04d}"
        self._elsewhere: list[str] | None = None  # the other folders, listed once
        self.loaded = 0
        self.computed = 0
        self.write_seconds = 0.0
        self._groups = {SHARED}  # zarr group metadata this writer already wrote

    def _tile(self, index: int, base: str | None = None) -> str:
        return f"{base or self.own}/tile-{index:06d}"

    def _marker_path(self, index: int, base: str | None = None) -> str:
        return shared_path(f"{self._tile(index, base)}.done")

    def _folders(self) -> list[str]:
        """Where a tile may have been kept: this writer's folder first, then one
        process's, then every rank folder of the digest (a precompute stopped on another
        number of ranks), listed once."""
        if self._elsewhere is None:
            names = self.store.backend.listdir(shared_path(self.folder))
            ranks = [f"{self.folder}/{n}" for n in names if _RANK_FOLDER.fullmatch(n)]
            self._elsewhere = [f for f in [self.folder, *ranks] if f != self.own]
        return [self.own, *self._elsewhere]

    def load(self, index: int, slots: np.ndarray, like: TileLayout) -> TileEntries | None:
        """Tile `index`'s entries if its marker and arrays verify and have the layout
        `like`, from the first folder that holds a trusted one (None otherwise)."""
        backend = self.store.backend
        for base in self._folders():
            try:
                raw = backend.read_bytes(self._marker_path(index, base))
            except FileNotFoundError:
                continue
            try:
                entries = self._verified(index, slots, like, raw, base)
            except (ValueError, KeyError, TypeError, OSError) as exc:
                log.warning(
                    "table %s: precompute tile %d in %s of %s is not trusted (%s); "
                    "computing it again",
                    self.param,
                    index,
                    base,
                    self.store.url,
                    exc,
                )
                self._discard(index, base)
                continue
            self.loaded += 1
            return entries
        return None

    def _verified(
        self, index: int, slots: np.ndarray, like: TileLayout, raw: bytes, base: str
    ) -> TileEntries:
        if len(raw) > _MARKER_MAX_BYTES:
            raise ValueError(f"its done-marker is {len(raw)} bytes, more than any marker")
        rec = load_bounded(raw)
        if not isinstance(rec, dict) or rec.get("kind") != _MARKER:
            raise ValueError("its done-marker is not one")
        body = {k: v for k, v in rec.items() if k not in ("sha256", "mac")}
        if rec.get("sha256") != _sha256(body):
            raise ValueError("its done-marker fails its sha256")
        mac = rec.get("mac")
        if not isinstance(mac, str) or not hmac.compare_digest(mac, self._mac(body)):
            raise ValueError("its done-marker fails its MAC under the job's key (forged?)")
        want = {"digest": self.digest, "tile": index, **_span(slots)}
        got = {k: rec.get(k) for k in want}
        if got != want:
            raise ValueError(f"its done-marker is of {got}, this precompute needs {want}")
        # the layout is checked before anything is allocated: the tile's reads say it
        n = like.entries
        shapes = {"index": ((n, 2), np.dtype(np.int64)), "values": ((n, like.dim), like.dtype)}
        metas = {name: ArrayMeta.from_json({**rec["arrays"][name], "path": ""}) for name in _ARRAYS}
        for name, (shape, dtype) in shapes.items():
            meta = metas[name]
            if meta.shape != shape or np.dtype(meta.dtype) != dtype:
                raise ValueError(
                    f"its array {name} is {meta.dtype}{list(meta.shape)}, the tile's entries "
                    f"are {dtype}{list(shape)}"
                )
        pairs, values = (self._array(index, name, metas[name], base) for name in _ARRAYS)
        for name, arr in zip(_ARRAYS, (pairs, values), strict=True):
            want = rec.get("array_macs", {}).get(name)
            if not isinstance(want, str) or not hmac.compare_digest(want, self._array_mac(arr)):
                raise ValueError(f"array {name} fails its MAC under the job's key (forged?)")
        return np.ascontiguousarray(pairs[:, 0]), np.ascontiguousarray(pairs[:, 1]), values

    def _array(self, index: int, name: str, meta: ArrayMeta, base: str) -> np.ndarray:
        """Array `name` of tile `index`, checked against the marker's checksum. Its path
        is ours, never the marker's: only the layout and the checksum are read there."""
        layout = (meta.shape, meta.dtype, meta.chunks or meta.shape)

        def read() -> tuple[np.ndarray, str]:
            sub = f"{self._tile(index, base)}/{name}"
            return read_array(self.store.backend, SHARED, sub, layout, meta.separator)

        arr, checksum = self.store.retry.call(read)
        if checksum != meta.checksum:
            raise ValueError(f"array {name} fails its checksum")
        return arr

    def save(self, index: int, slots: np.ndarray, entries: TileEntries) -> None:
        """Write tile `index`'s arrays, durable, then its done-marker (on the writer's
        thread when there is one: then this raises an earlier tile's failure).

        Raises:
            FencedError: another writer took the store over (nothing is written).
        """
        if self.writer is None:
            self._save(index, slots, entries)
            hooks.point(TILE_KEPT, step=self.computed, tile=index)
        else:
            self.writer.submit(lambda: self._save(index, slots, entries))

    def _fence(self) -> None:
        """Raise FencedError unless this writer may keep a tile now: it holds the
        store's lease (one process), or no lease generation newer than rank 0's exists
        (a rank of several, which holds none)."""
        if self.rank is not None:
            gen = self.rank[0]
            if self.store.backend.exists_fresh(lease_path(gen + 1)):
                raise FencedError(
                    f"{self.store.url}: rank {self.rank[1]}'s job (lease generation {gen}) "
                    f"was taken over by generation {gen + 1}; it keeps no more precompute "
                    "tiles. Stop this job; the new writer owns the store"
                )
            return
        lease = self.store.lease
        if lease is None:
            raise FencedError(
                f"{self.store.url}: the precompute keeps its tiles only under the writer "
                "lease; acquire it first"
            )
        lease.check()

    def _save(self, index: int, slots: np.ndarray, entries: TileEntries) -> None:
        t0 = time.perf_counter()
        self._fence()
        tile = self._tile(index)
        backend = self.store.backend
        arrays = {"index": np.column_stack(entries[:2]), "values": entries[2]}

        def write() -> dict[str, ArrayMeta]:
            # a tile folder without its marker is a crash's (or a failed try's) leftover
            backend.rm(shared_path(tile), recursive=True)
            ensure_groups(backend, SHARED, f"{tile}/index", self._groups)
            metas = {}
            for name, arr in arrays.items():
                checksum, chunks = write_array(backend, SHARED, f"{tile}/{name}", arr)
                metas[name] = written_meta(shared_path(f"{tile}/{name}"), arr, checksum, chunks)
            # one fsync pass per tile (files, folders, parents), not one per array
            backend.fsync_tree(shared_path(tile))
            return metas

        metas = self.store.retry.call(write)
        body = {
            "kind": _MARKER,
            "param": self.param,
            "digest": self.digest,
            "tile": index,
            **_span(slots),
            "entries": int(entries[0].shape[0]),
            "arrays": {name: m.to_json() for name, m in metas.items()},
            "array_macs": {name: self._array_mac(arr) for name, arr in arrays.items()},
        }
        data = json.dumps(
            {**body, "sha256": _sha256(body), "mac": self._mac(body)}, sort_keys=True
        ).encode()
        self.store.backend.create_once(self._marker_path(index), data)
        self.computed += 1
        self.write_seconds += time.perf_counter() - t0

    def _mac(self, body: dict[str, Any]) -> str:
        text = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.blake2b(text, key=self.mac_key, person=b"cc-tile-marker").hexdigest()

    def _array_mac(self, arr: np.ndarray) -> str:
        """Keyed BLAKE2b of an array's dtype, shape and C-order bytes (~650 MB/s here:
        a fraction of the time the precompute takes to compute them)."""
        a = np.ascontiguousarray(arr)
        h = hashlib.blake2b(key=self.mac_key, person=b"cc-tile-array")
        h.update(f"{a.dtype.str}{list(a.shape)}".encode())
        h.update(a.data.cast("B"))
        return h.hexdigest()

    def _discard(self, index: int, base: str) -> None:
        backend = self.store.backend
        backend.rm(self._marker_path(index, base))
        backend.rm(shared_path(self._tile(index, base)), recursive=True)


def _span(slots: np.ndarray) -> dict[str, Any]:
    """What a marker says of its tile's slots: count, first, last and a hash of them."""
    s = np.ascontiguousarray(slots, dtype=np.int64)
    return {
        "slots": int(s.size),
        "first_slot": int(s[0]) if s.size else None,
        "last_slot": int(s[-1]) if s.size else None,
        "slots_sha256": hashlib.sha256(s.data.cast("B")).hexdigest(),
    }


def _sha256(body: dict[str, Any]) -> str:
    return hashlib.sha256(
        json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    ).hexdigest()


def drop_tile_parts(store: Store, manifest: Manifest | None, params: list[str]) -> bool:
    """Delete every table's precompute parts once `manifest` (a committed version)
    references the CSC of each of `params` (the coalesced tables): they are then
    scratch no one reads. Nothing is deleted by a writer that was taken over.

    Returns:
        Whether the parts are gone (or there were none): False while some table's CSC is
        not yet in a committed version.
    """
    if manifest is None:
        return False
    names = manifest.arrays
    for p in params:  # whole, or in parts (`embedding.csc_shards`)
        parts = emb_name(p, "csc/slots-")
        if emb_name(p, "csc/values") not in names and not any(n.startswith(parts) for n in names):
            return False
    lease = store.lease
    if lease is None or lease.taken_over():
        return False
    path = shared_path(PRECOMPUTE)
    if store.backend.exists(path):
        store.backend.rm(path, recursive=True)
        log.info(
            "%s: precompute parts deleted (version %d holds the CSC)", store.url, manifest.version
        )
    return True
