"""The writer lease: one writer per store, a generation number for fencing, and an
expiry that a live writer keeps renewing.

Each generation is its own exclusively created object `leases/<gen>.json`, so two
writers racing for the same generation cannot both win, on local disk or on an
object store (no read-modify-write of a shared file is needed).

Fencing: generation g may commit only while `leases/<g+1>.json` does not exist.
Generations are contiguous (a taker creates newest + 1 exclusively, so g + k exists only
if g + 1 does), so one uncached probe of g + 1 (a HEAD on S3) answers "was I taken
over?" on every backend. A directory listing would not do: s3fs caches listings, and a
cached one never shows another process's new generation.

Expiry: the holder rewrites `leases/<gen>.heartbeat` every `expiry_s / 3` from a daemon
thread (and at begin/commit when one is due). A holder is judged alive by pid and
process start time when it is on this host (exact, at once), and by its heartbeat
otherwise: once `expiry_s` has passed since its last renewal, it is dead and the lease
is taken without `takeover`. The expiry compares the holder's clock with the reader's:
hosts' clocks must agree to well within `expiry_s` (NTP does).
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
import uuid
import weakref
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from .backend import Backend
from .errors import FencedError, LeaseHeldError, StoreError
from .paths import (
    LEASES,
    lease_heartbeat_path,
    lease_path,
    lease_released_path,
    parse_lease_name,
)
from .process import owner_alive, process_start, this_host

__all__ = ["DEFAULT_LEASE_EXPIRY_S", "Lease", "acquire_lease", "current_holder"]

log = logging.getLogger("state.lease")

#: Seconds a writer's lease lives without renewal (it renews every third of this).
DEFAULT_LEASE_EXPIRY_S = 60.0


def _generations(backend: Backend) -> list[int]:
    found = (parse_lease_name(name) for name in backend.listdir_fresh(LEASES))
    return sorted(g for g in found if g is not None)


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _last_renewal(backend: Backend, gen: int, rec: dict[str, Any]) -> float | None:
    """The newest of the record's acquisition time and its heartbeat's renewal time."""
    times = [_number(rec.get("renewed"))]
    try:
        beat = json.loads(backend.read_bytes(lease_heartbeat_path(gen)))
    except (FileNotFoundError, ValueError):
        beat = None  # no renewal yet, or a damaged one: the record's time counts
    if isinstance(beat, dict) and beat.get("generation") == gen:
        times.append(_number(beat.get("renewed")))
    known = [t for t in times if t is not None]
    return max(known) if known else None


def current_holder(backend: Backend) -> dict[str, Any] | None:
    """The newest lease record, read without caches, or None when no lease was ever taken.

    Besides the record's own fields (owner, generation, host, pid, acquired, expiry_s)
    it holds `released` (bool), `renewed` (Unix seconds of the last renewal) and
    `expires` (Unix seconds; None for a lease written without an expiry).

    Raises:
        StoreError: the newest lease record is not one.
    """
    gens = _generations(backend)
    if not gens:
        return None
    gen = gens[-1]
    try:
        rec = json.loads(backend.read_bytes(lease_path(gen)))
    except ValueError:
        rec = None
    if not isinstance(rec, dict) or rec.get("generation") != gen:
        raise StoreError(
            f"{backend.url}: {lease_path(gen)} is not a lease record of generation {gen}; "
            "the store's lease state is damaged. If no job writes to this store, move that "
            "file away and retry"
        )
    rec["released"] = backend.exists(lease_released_path(gen))
    expiry = _number(rec.get("expiry_s"))
    renewed = _last_renewal(backend, gen, rec)
    rec["renewed"] = renewed
    rec["expires"] = None if expiry is None or renewed is None else renewed + expiry
    return rec


def _holder_alive(rec: dict[str, Any], now: float) -> bool:
    if rec.get("released"):
        return False
    alive = owner_alive(rec.get("host"), rec.get("pid"), rec.get("proc_start"))
    if alive is not None:
        return alive  # on this host: pid and start time tell exactly, at once
    expires = rec.get("expires")
    return expires is None or now < expires  # no expiry recorded: cannot tell, assume alive


def _held_message(url: str, rec: dict[str, Any], now: float) -> str:
    who = (
        f"{url} is held by writer {rec.get('owner')} (lease generation {rec.get('generation')}, "
        f"since {rec.get('acquired')}"
    )
    if owner_alive(rec.get("host"), rec.get("pid"), rec.get("proc_start")):
        why = f"; its process {rec.get('pid')} runs on this host)"
    elif rec.get("expires") is None:
        why = ", on another host, with no expiry recorded)"
    else:
        why = (
            f", on host {rec.get('host')}, renewed {now - rec['renewed']:.0f} s ago; it expires "
            f"in {rec['expires'] - now:.0f} s unless renewed)"
        )
    return (
        f"{who}{why}; a second writer is refused. If that job is dead, wait for its lease "
        "to expire or take over with takeover=True (CLI: --takeover)"
    )


@dataclass(kw_only=True, slots=True, weakref_slot=True)
class Lease:
    """A writer's hold on a store.

    Attributes:
        backend: the store's storage.
        generation: this writer's lease generation.
        owner: `host:pid:random`, recorded in every manifest it commits.
        expiry_s: seconds the lease lives without renewal.
        released: the lease was given up.
        renewed: Unix seconds of the last renewal written.
    """

    backend: Backend
    generation: int
    owner: str
    expiry_s: float = DEFAULT_LEASE_EXPIRY_S
    released: bool = False
    renewed: float = 0.0
    _stop: threading.Event = field(default_factory=threading.Event, init=False, repr=False)

    @property
    def renew_every_s(self) -> float:
        """Seconds between renewals: a third of the expiry, so two may fail in a row."""
        return self.expiry_s / 3

    def taken_over(self) -> bool:
        """Whether a newer generation exists, asked of the storage, not of a cache."""
        return self.backend.exists_fresh(lease_path(self.generation + 1))

    def check(self) -> None:
        """Raise FencedError when a newer generation took the store over; renew the
        expiry when a renewal is due.

        Called at begin and at commit. It reads without caches, and clears the
        filesystem's cached listings first, so what the caller reads next (the version
        number begin picks, a conflicting manifest) is fresh too.
        """
        if self.released:
            raise FencedError(
                f"{self.backend.url}: lease generation {self.generation} was released; "
                "acquire the lease again to write"
            )
        self.backend.invalidate()
        if self.taken_over():
            self._stop.set()
            newest = max(_generations(self.backend), default=self.generation + 1)
            raise FencedError(
                f"{self.backend.url}: writer {self.owner} (lease generation {self.generation}) "
                f"was taken over by generation {newest}; it may not commit. Stop this job; "
                "the new writer owns the store"
            )
        if time.time() - self.renewed >= self.renew_every_s:
            self._renew_logged()

    def renew(self) -> None:
        """Write this generation's heartbeat: the lease now expires `expiry_s` from now."""
        now = time.time()
        beat = {"owner": self.owner, "generation": self.generation, "renewed": now}
        self.backend.replace(lease_heartbeat_path(self.generation), json.dumps(beat).encode())
        self.renewed = now

    def _renew_logged(self) -> None:
        # A failed renewal must not fail a commit: the next one retries, and a lease
        # that does expire meanwhile is fenced, never silently shared.
        try:
            self.renew()
        except Exception as exc:  # storage errors of every backend
            log.warning(
                "%s: renewing lease generation %d failed: %s",
                self.backend.url,
                self.generation,
                exc,
            )

    def start_heartbeat(self) -> None:
        """Renew from a daemon thread every `renew_every_s` until released, fenced, or
        dropped (the thread holds the lease only weakly)."""
        ref = weakref.ref(self)
        weakref.finalize(self, self._stop.set)
        threading.Thread(
            target=_heartbeat,
            args=(ref, self._stop, self.renew_every_s),
            name=f"lease-heartbeat-g{self.generation}",
            daemon=True,
        ).start()

    def release(self) -> None:
        """Give the store up; the next writer takes generation + 1 without takeover."""
        if self.released:
            return
        self.released = True
        self._stop.set()
        try:
            self.backend.create_once(lease_released_path(self.generation), b"{}")
        except FileExistsError:
            pass

    def as_record(self) -> dict[str, Any]:
        return {"owner": self.owner, "generation": self.generation}


def _heartbeat(ref: weakref.ref[Lease], stop: threading.Event, every: float) -> None:
    while not stop.wait(every):
        lease = ref()
        if lease is None:
            return
        try:
            if lease.taken_over():
                return  # fenced: only the newest generation's heartbeat counts
            lease.renew()
        except Exception as exc:  # storage errors of every backend: retry next time
            log.warning(
                "%s: renewing lease generation %d failed: %s",
                lease.backend.url,
                lease.generation,
                exc,
            )
        del lease


def acquire_lease(
    backend: Backend, *, takeover: bool = False, expiry_s: float = DEFAULT_LEASE_EXPIRY_S
) -> Lease:
    """Take the store's writer lease, and keep it renewed from a daemon thread.

    Args:
        backend: the store.
        takeover: take the lease even if its holder looks alive.
        expiry_s: seconds this lease lives without renewal; a writer on another host
            may take it without `takeover` once that long has passed since the last
            renewal (it renews every `expiry_s / 3`).

    Raises:
        ValueError: `expiry_s` is not a finite number > 0.
        LeaseHeldError: another live writer holds it, or won a race for it.
        StoreError: the newest lease record is damaged.
    """
    if _number(expiry_s) is None or not expiry_s > 0:
        raise ValueError(
            f"lease expiry_s={expiry_s!r} must be a finite number of seconds > 0 "
            f"(default {DEFAULT_LEASE_EXPIRY_S:g})"
        )
    rec = current_holder(backend)
    now = time.time()
    gen = 0
    if rec is not None:
        gen = int(rec["generation"])
        if _holder_alive(rec, now):
            if not takeover:
                raise LeaseHeldError(_held_message(backend.url, rec, now))
            log.warning(
                "%s: taking over lease generation %d of live writer %s",
                backend.url,
                gen,
                rec.get("owner"),
            )
        elif not rec.get("released") and rec.get("expires") is not None:
            log.warning(
                "%s: lease generation %d of writer %s expired %.0f s ago; taking it",
                backend.url,
                gen,
                rec.get("owner"),
                now - rec["expires"],
            )
    new_gen = gen + 1
    host, pid = this_host(), os.getpid()
    owner = f"{host}:{pid}:{uuid.uuid4().hex[:8]}"
    record = {
        "owner": owner,
        "generation": new_gen,
        "host": host,
        "pid": pid,
        "proc_start": process_start(pid),
        "acquired": datetime.fromtimestamp(now, UTC).isoformat(),
        "renewed": now,
        "expiry_s": float(expiry_s),
    }
    backend.makedirs(LEASES)
    try:
        backend.create_once(lease_path(new_gen), json.dumps(record).encode())
    except FileExistsError as exc:
        raise LeaseHeldError(
            f"{backend.url}: another writer took lease generation {new_gen} at the same time; "
            "a second writer is refused"
        ) from exc
    lease = Lease(
        backend=backend, generation=new_gen, owner=owner, expiry_s=float(expiry_s), renewed=now
    )
    lease.start_heartbeat()
    return lease
