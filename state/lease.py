"""The writer lease: one writer per store, with a generation number for fencing.

Each generation is its own exclusively created object `leases/<gen>.json`, so two
writers racing for the same generation cannot both win, on local disk or on an
object store (no read-modify-write of a shared file is needed). A writer may commit
only while no higher generation exists: a writer whose lease was taken over is fenced.
"""

from __future__ import annotations

import json
import os
import socket
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from .backend import Backend
from .errors import FencedError, LeaseHeldError

__all__ = ["Lease", "acquire_lease", "current_holder"]

_DIR = "leases"


def _gen_path(gen: int) -> str:
    return f"{_DIR}/{gen:08d}.json"


def _released_path(gen: int) -> str:
    return f"{_DIR}/{gen:08d}.released"


def _proc_start(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except OSError:
        return None


def _generations(backend: Backend) -> list[int]:
    gens = []
    for name in backend.listdir(_DIR):
        if name.endswith(".json") and name[:-5].isdigit():
            gens.append(int(name[:-5]))
    return sorted(gens)


def current_holder(backend: Backend) -> dict[str, Any] | None:
    """The newest lease record, or None when no lease was ever taken."""
    gens = _generations(backend)
    if not gens:
        return None
    rec: dict[str, Any] = json.loads(backend.read_bytes(_gen_path(gens[-1])))
    rec["released"] = backend.exists(_released_path(gens[-1]))
    return rec


def _holder_alive(rec: dict[str, Any]) -> bool:
    if rec.get("released"):
        return False
    if rec.get("host") != socket.gethostname():
        return True  # cannot tell from here: assume alive, the user may take over
    pid = int(rec.get("pid", -1))
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    start = rec.get("proc_start")
    return start is None or _proc_start(pid) == start  # a reused pid is another process


@dataclass(kw_only=True, slots=True)
class Lease:
    """A writer's hold on a store."""

    backend: Backend
    generation: int
    owner: str
    released: bool = False

    def check(self) -> None:
        """Raise FencedError when a newer generation took the store over."""
        if self.released:
            raise FencedError(
                f"{self.backend.url}: lease generation {self.generation} was released"
            )
        gens = _generations(self.backend)
        if gens and gens[-1] != self.generation:
            raise FencedError(
                f"{self.backend.url}: writer {self.owner} (lease generation {self.generation}) "
                f"was taken over by generation {gens[-1]}; it may not commit. Stop this job; "
                "the new writer owns the store"
            )

    def release(self) -> None:
        """Give the store up; the next writer takes generation + 1 without takeover."""
        if self.released:
            return
        self.released = True
        try:
            self.backend.create_once(_released_path(self.generation), b"{}")
        except FileExistsError:
            pass

    def as_record(self) -> dict[str, Any]:
        return {"owner": self.owner, "generation": self.generation}


def acquire_lease(backend: Backend, *, takeover: bool = False) -> Lease:
    """Take the store's writer lease.

    Args:
        backend: the store.
        takeover: take the lease even if its holder looks alive (or is on another host).

    Raises:
        LeaseHeldError: another live writer holds it, or won a race for it.
    """
    rec = current_holder(backend)
    gen = 0
    if rec is not None:
        gen = int(rec["generation"])
        if _holder_alive(rec) and not takeover:
            raise LeaseHeldError(
                f"{backend.url} is held by writer {rec.get('owner')} (lease generation {gen}, "
                f"since {rec.get('acquired')}); a second writer is refused. If that job is "
                "dead, take over with takeover=True (CLI: --takeover)"
            )
    new_gen = gen + 1
    owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
    record = {
        "owner": owner,
        "generation": new_gen,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "proc_start": _proc_start(os.getpid()),
        "acquired": datetime.now(UTC).isoformat(),
    }
    backend.makedirs(_DIR)
    try:
        backend.create_once(_gen_path(new_gen), json.dumps(record).encode())
    except FileExistsError as exc:
        raise LeaseHeldError(
            f"{backend.url}: another writer took lease generation {new_gen} at the same time; "
            "a second writer is refused"
        ) from exc
    return Lease(backend=backend, generation=new_gen, owner=owner)
