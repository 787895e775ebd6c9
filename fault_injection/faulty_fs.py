"""`faulty://`: an fsspec filesystem that wraps any other and injects storage faults.

Faults are drawn from a seeded generator (or forced on a schedule), so a failing run
replays exactly. Every injected fault is counted by kind in `FaultyFileSystem.injected`.

Kinds:
    transient    ConnectionResetError / TimeoutError before the operation (retries absorb)
    lost_response the write lands, then TimeoutError (the commit's write_id read-back absorbs)
    permanent    OSError(EIO) on every write once triggered
    torn         only a prefix of the bytes is stored, the write is acknowledged
    lost         acknowledged, never stored
    flip_rest    one bit flipped in what is stored
    flip_read    one bit flipped in what a read returns
    slow         the write sleeps `slow_s` first
    full         OSError(ENOSPC) once `capacity_bytes` have been written
"""

from __future__ import annotations

import errno
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import fsspec
import numpy as np
from fsspec import AbstractFileSystem

__all__ = ["FaultPlan", "FaultyFileSystem", "faulty_filesystem"]

KINDS = (
    "transient",
    "lost_response",
    "permanent",
    "torn",
    "lost",
    "flip_rest",
    "flip_read",
    "slow",
)


@dataclass(frozen=True, kw_only=True, slots=True)
class FaultPlan:
    """Which faults to inject, how often, and where.

    Probabilities are per operation of the kind they apply to (reads or writes).
    `paths` restricts faults to paths containing one of the substrings (e.g. "/c."
    for chunks, "manifests/" for commits); empty means every path.
    """

    seed: int = 0
    """Seed of the fault generator."""
    transient: float = 0.0
    """Probability a read or write raises a transient error before doing anything."""
    lost_response: float = 0.0
    """Probability a write lands and then raises TimeoutError."""
    permanent_after: int | None = None
    """Writes from this count on raise OSError(EIO)."""
    torn: float = 0.0
    """Probability a write stores only a prefix."""
    lost: float = 0.0
    """Probability a write is acknowledged and dropped."""
    flip_rest: float = 0.0
    """Probability a write stores one flipped bit."""
    flip_read: float = 0.0
    """Probability a read returns one flipped bit."""
    slow: float = 0.0
    """Probability a write sleeps `slow_s` first."""
    slow_s: float = 0.01
    """Sleep of a slow write, seconds."""
    capacity_bytes: int | None = None
    """The disk is full (ENOSPC) once this many bytes were written."""
    paths: tuple[str, ...] = ()
    """Only paths containing one of these substrings get faults."""
    protect: tuple[str, ...] = ("leases/", "/secret/")
    """Paths never faulted (the lease and the key are not what a test is about)."""

    def __post_init__(self) -> None:
        for name in (
            "transient",
            "lost_response",
            "torn",
            "lost",
            "flip_rest",
            "flip_read",
            "slow",
        ):
            p = getattr(self, name)
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"FaultPlan.{name}={p}: a probability must lie in [0, 1]")


@dataclass
class _State:
    rng: np.random.Generator
    writes: int = 0
    written_bytes: int = 0
    injected: Counter[str] = field(default_factory=Counter)
    log: list[tuple[str, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


class FaultyFileSystem(AbstractFileSystem):  # type: ignore[misc]
    """Wraps `target` (an fsspec filesystem) and injects the faults of `plan`.

    Args:
        target: the filesystem that really stores the bytes.
        plan: what to inject.
    """

    protocol = ("faulty",)
    cachable = False

    def __init__(self, target: AbstractFileSystem, plan: FaultPlan, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.target = target
        self.plan = plan
        self._state = _State(rng=np.random.default_rng(plan.seed))
        # the commit protocol may use it: creates are delegated to the target
        tprotos = target.protocol if isinstance(target.protocol, tuple) else (target.protocol,)
        self.cocoon_exclusive_create = bool(set(tprotos) & {"memory", "s3", "s3a", "file", "local"})
        self.armed = True

    # bookkeeping -----------------------------------------------------------------
    @property
    def injected(self) -> Counter[str]:
        """How many faults of each kind were injected so far."""
        return self._state.injected

    @property
    def log(self) -> list[tuple[str, str]]:
        """(kind, path) of every fault left at rest: torn, lost and flipped writes."""
        return self._state.log

    def _strip_protocol(self, path: str) -> str:
        path = str(path)
        if path.startswith("faulty://"):
            path = path[len("faulty://") :]
        return str(self.target._strip_protocol(path))

    def _eligible(self, path: str) -> bool:
        if not self.armed or any(p in path for p in self.plan.protect):
            return False
        return not self.plan.paths or any(p in path for p in self.plan.paths)

    def _roll(self, kind: str, p: float) -> bool:
        if p <= 0.0:
            return False
        with self._state.lock:
            hit = bool(self._state.rng.random() < p)
            if hit:
                self._state.injected[kind] += 1
        return hit

    def _transient(self, path: str) -> None:
        if self._eligible(path) and self._roll("transient", self.plan.transient):
            raise ConnectionResetError(
                f"faulty://{path}: injected transient error (connection reset)"
            )

    # reads -----------------------------------------------------------------------
    def cat_file(
        self, path: str, start: int | None = None, end: int | None = None, **kw: Any
    ) -> bytes:
        path = self._strip_protocol(path)
        self._transient(path)
        data = bytes(self.target.cat_file(path, start=start, end=end, **kw))
        if data and self._eligible(path) and self._roll("flip_read", self.plan.flip_read):
            data = self._flip(data)
        return data

    def ls(self, path: str, detail: bool = True, **kw: Any) -> Any:
        return self.target.ls(self._strip_protocol(path), detail=detail, **kw)

    def info(self, path: str, **kw: Any) -> Any:
        return self.target.info(self._strip_protocol(path), **kw)

    def exists(self, path: str, **kw: Any) -> bool:
        return bool(self.target.exists(self._strip_protocol(path), **kw))

    def find(self, path: str, *args: Any, **kw: Any) -> Any:
        return self.target.find(self._strip_protocol(path), *args, **kw)

    # writes ----------------------------------------------------------------------
    def pipe_file(self, path: str, value: bytes, mode: str = "overwrite", **kw: Any) -> None:
        path = self._strip_protocol(path)
        data = bytes(value)
        if not self._eligible(path):
            self.target.pipe_file(path, data, mode=mode, **kw)
            return
        plan, st = self.plan, self._state
        with st.lock:
            st.writes += 1
            writes = st.writes
        if plan.permanent_after is not None and writes > plan.permanent_after:
            st.injected["permanent"] += 1
            raise OSError(errno.EIO, f"faulty://{path}: injected permanent I/O error")
        if plan.capacity_bytes is not None and st.written_bytes + len(data) > plan.capacity_bytes:
            st.injected["full"] += 1
            raise OSError(errno.ENOSPC, f"faulty://{path}: No space left on device (injected)")
        self._transient(path)
        if self._roll("slow", plan.slow):
            time.sleep(plan.slow_s)
        if self._roll("lost", plan.lost):
            st.log.append(("lost", path))
            return
        if data and self._roll("torn", plan.torn):
            data = data[: int(st.rng.integers(0, len(data)))]
            st.log.append(("torn", path))
        elif data and self._roll("flip_rest", plan.flip_rest):
            data = self._flip(data)
            st.log.append(("flip_rest", path))
        self.target.pipe_file(path, data, mode=mode, **kw)
        with st.lock:
            st.written_bytes += len(data)
        if self._roll("lost_response", plan.lost_response):
            raise TimeoutError(f"faulty://{path}: injected lost response (the write landed)")

    def invalidate_cache(self, path: str | None = None) -> None:
        # The lease check clears cached listings before it probes (S3): pass it on, or a
        # takeover through this wrapper would be judged from a stale listing.
        self.target.invalidate_cache(path)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        self.target.makedirs(self._strip_protocol(path), exist_ok=exist_ok)

    def mkdir(self, path: str, create_parents: bool = True, **kw: Any) -> None:
        self.target.mkdir(self._strip_protocol(path), create_parents=create_parents, **kw)

    def rm(self, path: Any, recursive: bool = False, maxdepth: int | None = None) -> None:
        self.target.rm(self._strip_protocol(path), recursive=recursive, maxdepth=maxdepth)

    def rm_file(self, path: str) -> None:
        self.target.rm_file(self._strip_protocol(path))

    def _open(self, path: str, mode: str = "rb", **kw: Any) -> Any:
        if "r" in mode:
            return self.target._open(self._strip_protocol(path), mode=mode, **kw)
        raise NotImplementedError("faulty:// writes go through pipe_file")

    def _flip(self, data: bytes) -> bytes:
        buf = bytearray(data)
        bit = int(self._state.rng.integers(0, len(buf) * 8))
        buf[bit // 8] ^= 1 << (bit % 8)
        return bytes(buf)


def faulty_filesystem(target_url: str, plan: FaultPlan, **storage_options: Any) -> FaultyFileSystem:
    """A `faulty://` filesystem over the filesystem of `target_url` (e.g. memory://)."""
    target, _ = fsspec.core.url_to_fs(target_url, **storage_options)
    return FaultyFileSystem(target, plan)
