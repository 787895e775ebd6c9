"""The far tier: emulated CXL memory with near-memory compute (Cocoon's NMP).

The shard lives in a file (its folder configurable: tmpfs for memory, a local disk for
capacity beyond RAM), created owner-only because the history is secret (I6). The
training process writes new slots into it directly (`pwrite`), as a CPU writes CXL.mem;
a worker process that reads the same file computes the GEMV next to the data and returns
only the partial result, through a shared-memory file. Nobody maps the shard: every
access is a positioned read or write of a bounded buffer (`far_io`), so neither process's
resident memory grows with the shard (a mapped file's touched pages count in RSS; a
10 GB ring on disk would have shown up as 10 GB of both processes). An optional link
throttle (bytes/s) models the slow interconnect for everything that crosses it: slot
writes, reads, a baseline's pull of the whole shard, and the worker's mix-in / result-out.

The file is scratch, not the checkpoint: a version stores the ring's slots in the store,
and a resume writes them back into a new far file.

A worker that dies mid-GEMV is replaced and the GEMV recomputed (the history is in the
file, untouched by a GEMV); past `max_respawns` replacements it is a `TierError`. The
output buffer is filled with NaN before each request, so a result never comes from a
request that did not finish.

An owner killed outright (SIGKILL) cannot remove its folders, and on tmpfs they hold
RAM. Each folder's name therefore says who owns it (pid, process start time, and a tag
of the host and pid namespace); every far tier's start-up removes the folders of owners
that no longer run, and never touches a live owner's or one it cannot judge (another
host or container sharing the folder, or another user's).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import select
import shutil
import subprocess
import sys
import tempfile
import time
from typing import IO, Any

import numpy as np

from cocoon_ckpt.tiers.base import Tier, TierError, TierKind
from cocoon_ckpt.tiers.far_io import (
    private_file,
    private_memmap,
    read_at,
    read_columns,
    write_at,
)
from state.process import owner_alive, process_start, this_host

__all__ = ["FarTier", "sweep_dead_owners"]

log = logging.getLogger(__name__)


class _WorkerDied(Exception):
    pass


def _shared_memory_dir() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


# cocoon-far-[io-]<pid>.<start>.<where>-<random>: <where> tags the host and pid namespace,
# the only places where <pid>.<start> names one process.
_OWNED = re.compile(r"^cocoon-far-(?:io-)?(\d+)\.(\d+)\.([0-9a-f]{12})-")


def _where() -> str:
    try:
        pid_ns = str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        pid_ns = ""
    return hashlib.sha256(f"{this_host()}/{pid_ns}".encode()).hexdigest()[:12]


def _owner_tag() -> str:
    pid = os.getpid()
    return f"{pid}.{process_start(pid) or 0}.{_where()}"


def sweep_dead_owners(folders: list[str | None]) -> list[str]:
    """Remove far-tier folders whose owner process no longer runs.

    Args:
        folders: where far tiers put their folders (None: the system temp folder).

    Returns:
        The folders removed. A folder of a live owner, of another host or pid namespace,
        or of another user, is left alone.
    """
    where, uid, removed = _where(), os.getuid(), []
    for parent in dict.fromkeys(f or tempfile.gettempdir() for f in folders):
        try:
            entries = list(os.scandir(parent))
        except OSError:
            continue
        for entry in entries:
            m = _OWNED.match(entry.name)
            if m is None or m.group(3) != where:
                continue
            try:
                if not entry.is_dir(follow_symlinks=False) or entry.stat().st_uid != uid:
                    continue
            except OSError:
                continue
            start = m.group(2) if m.group(2) != "0" else None
            if owner_alive(this_host(), int(m.group(1)), start) is False:
                shutil.rmtree(entry.path, ignore_errors=True)
                removed.append(entry.path)
    if removed:
        log.info("removed %d far-tier folder(s) of dead owners: %s", len(removed), removed)
    return removed


class FarTier(Tier):
    """History columns in a memory-mapped file, computed by a worker process near it.

    Args:
        capacity: bytes of far memory the shard may use.
        folder: where the memory-mapped file lies (default: the system temp folder); a
            private 0700 folder is made inside it and removed on close.
        link_bytes_per_s: model a link of this bandwidth for data crossing it (None: no
            throttle).
        max_respawns: worker replacements allowed over the tier's life.
        timeout_s: a worker silent this long on one request is taken as dead.
    """

    kind = TierKind.FAR

    def __init__(
        self,
        capacity: int,
        *,
        folder: str | None = None,
        link_bytes_per_s: float | None = None,
        max_respawns: int = 2,
        timeout_s: float = 600.0,
    ) -> None:
        super().__init__(capacity)
        if link_bytes_per_s is not None and not link_bytes_per_s > 0:
            raise ValueError(f"FarTier link_bytes_per_s={link_bytes_per_s} must be > 0 or None")
        self.link_bytes_per_s = link_bytes_per_s
        self.max_respawns = max_respawns
        self.respawns = 0
        self.timeout_s = timeout_s
        self.pre_delay_s = 0.0
        """Seconds the worker waits before computing (fault tests kill it meanwhile)."""
        shm = _shared_memory_dir()
        sweep_dead_owners([folder, shm])
        tag = _owner_tag()
        self._dir = tempfile.mkdtemp(prefix=f"cocoon-far-{tag}-", dir=folder)
        os.chmod(self._dir, 0o700)
        self._shm = tempfile.mkdtemp(prefix=f"cocoon-far-io-{tag}-", dir=shm)
        os.chmod(self._shm, 0o700)
        self._proc: subprocess.Popen[bytes] | None = None
        self._fd: int | None = None
        self._mix: Any = None
        self._out: Any = None
        self._seq = 0

    @property
    def worker_pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    # -- the worker ----------------------------------------------------------------
    def _start_worker(self) -> None:
        self._stop_worker()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "cocoon_ckpt.tiers._far_worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            close_fds=True,
        )

    def _stop_worker(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            try:
                if proc.stdin is not None:
                    proc.stdin.write(b'{"op": "exit"}\n')
                    proc.stdin.flush()
                proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                proc.kill()
                proc.wait()
        for f in (proc.stdin, proc.stdout):
            if f is not None:
                f.close()

    def _call(self, cmd: dict[str, Any]) -> dict[str, Any]:
        proc = self._proc
        if proc is None or proc.poll() is not None:
            raise _WorkerDied()
        stdin: IO[bytes] | None = proc.stdin
        stdout: IO[bytes] | None = proc.stdout
        if stdin is None or stdout is None:
            raise _WorkerDied()
        try:
            stdin.write((json.dumps(cmd) + "\n").encode())
            stdin.flush()
        except OSError:
            raise _WorkerDied() from None
        ready, _, _ = select.select([stdout], [], [], self.timeout_s)
        line = stdout.readline() if ready else b""
        if not line:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            raise _WorkerDied()
        res: dict[str, Any] = json.loads(line)
        if not res.get("ok"):
            raise TierError(f"far tier worker refused {cmd['op']}: {res.get('error')}")
        return res

    def _open_cmd(self) -> dict[str, Any]:
        return {
            "op": "open",
            "path": os.path.join(self._dir, "history"),
            "mix_path": os.path.join(self._shm, "mix"),
            "out_path": os.path.join(self._shm, "out"),
            "slots": self.slots,
            "width": self.width,
            "dtype": self.dtype.name,
            "link_bytes_per_s": self.link_bytes_per_s,
        }

    def _with_worker(self, cmd: dict[str, Any], before: Any = None) -> dict[str, Any]:
        """Send `cmd`, replacing a dead worker and resending, up to `max_respawns`."""
        while True:
            if before is not None:
                before()
            try:
                if self._proc is None:
                    self._start_worker()
                    if self._fd is not None and cmd["op"] != "open":
                        self._call(self._open_cmd())
                return self._call(cmd)
            except _WorkerDied:
                code = self._proc.returncode if self._proc is not None else None
                if self.respawns >= self.max_respawns:
                    self._stop_worker()
                    raise TierError(
                        f"far tier worker died (exit {code}) during {cmd['op']} and "
                        f"{self.respawns} replacement(s) are used up; the far shard's history "
                        f"is intact in {self._dir}, but no result was produced"
                    ) from None
                self.respawns += 1
                log.warning(
                    "far tier worker died (exit %s) during %s; starting replacement %d of %d "
                    "and recomputing",
                    code,
                    cmd["op"],
                    self.respawns,
                    self.max_respawns,
                )
                self._proc = None

    # -- link model in this process -------------------------------------------------
    def _link_wait(self, start: float, nbytes: int) -> None:
        if self.link_bytes_per_s:
            due = start + nbytes / self.link_bytes_per_s
            now = time.perf_counter()
            if due > now:
                time.sleep(due - now)

    # -- Tier ----------------------------------------------------------------------
    def _allocate(self) -> None:
        if not self.width or not self.slots:
            return
        self._fd = private_file(os.path.join(self._dir, "history"), self.nbytes)
        self._mix = private_memmap(os.path.join(self._shm, "mix"), self.dtype, (self.slots,))
        self._out = private_memmap(os.path.join(self._shm, "out"), self.dtype, (self.width,))
        self._with_worker(self._open_cmd())

    def _shard_fd(self) -> int:
        if self._fd is None:
            raise TierError("far tier holds no shard file")
        return self._fd

    def _write_slot(self, slot: int, values: np.ndarray) -> None:
        t0 = time.perf_counter()
        write_at(self._shard_fd(), values, slot * self.width * self.dtype.itemsize)
        self._link_wait(t0, values.nbytes)

    def _read_slot(self, slot: int) -> np.ndarray:
        t0 = time.perf_counter()
        out = np.empty(self.width, dtype=self.dtype)
        read_at(self._shard_fd(), out, slot * self.width * self.dtype.itemsize)
        self._link_wait(t0, out.nbytes)
        return out

    def _pull(self, lo: int, hi: int) -> np.ndarray:
        t0 = time.perf_counter()
        out = np.empty((self.slots, hi - lo), dtype=self.dtype)
        read_columns(self._shard_fd(), out, self.width, lo)
        self._link_wait(t0, out.nbytes)
        return out

    def _gemv(self, mix: np.ndarray) -> np.ndarray:
        self._seq += 1

        def fill() -> None:
            self._mix[...] = mix
            self._out[...] = np.nan

        self._with_worker(
            {"op": "gemv", "seq": self._seq, "pre_delay_s": self.pre_delay_s}, before=fill
        )
        return np.array(self._out)

    def _profile(self, slots: int, width: int, dtype: np.dtype[Any], reps: int) -> list[float]:
        cmd = {
            "op": "profile",
            "path": os.path.join(self._dir, "profile-scratch"),
            "slots": slots,
            "width": width,
            "dtype": dtype.name,
            "reps": reps,
            "link_bytes_per_s": self.link_bytes_per_s,
        }
        times: list[float] = self._with_worker(cmd)["times"]
        return times

    def _close(self) -> None:
        self._stop_worker()
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
        self._mix = self._out = None
        shutil.rmtree(self._dir, ignore_errors=True)
        shutil.rmtree(self._shm, ignore_errors=True)
