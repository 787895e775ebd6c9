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
from .canonical_json import load_bounded
from .errors import FencedError, LeaseHeldError, StoreError
from .paths import (
    LEASES,
    lease_heartbeat_path,
    lease_path,
    lease_released_path,
    parse_lease_name,
)
from .process import owner_alive, process_start, this_host

__all__ = [
    "DEFAULT_LEASE_EXPIRY_S",
    "DamagedLeaseError",
    "Lease",
    "acquire_lease",
    "current_holder",
]

log = logging.getLogger(__name__)

#: Seconds a writer's lease lives without renewal (it renews every third of this).
DEFAULT_LEASE_EXPIRY_S = 60.0
#: The longest expiry a reader believes of a lease record, seconds (a week): a planted
#: `expiry_s: 1e308` would otherwise hold the store for ever.
MAX_BELIEVED_EXPIRY_S = 7 * 24 * 3600.0


def _generations(backend: Backend) -> list[int]:
    """The store's lease generations, oldest first: the run of consecutive numbers from
    the oldest. A taker creates newest + 1, so generations never skip a number; a record
    beyond a gap was put there by hand or by someone else, and is not a generation (it
    would otherwise be the newest and block every writer until --takeover)."""
    found = sorted(g for g in map(parse_lease_name, backend.listdir_fresh(LEASES)) if g is not None)
    for i in range(1, len(found)):
        if found[i] != found[i - 1] + 1:
            log.warning(
                "%s: ignoring lease record %s: generations run %d..%d, and a writer never "
                "skips one",
                backend.url,
                lease_path(found[i]),
                found[0],
                found[i - 1],
            )
            return found[:i]
    return found


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _expiry(rec: dict[str, Any]) -> float | None:
    """The record's expiry in seconds, at most `MAX_BELIEVED_EXPIRY_S`; None where it
    records none (or not a positive number)."""
    expiry = _number(rec.get("expiry_s"))
    return None if expiry is None or expiry <= 0 else min(expiry, MAX_BELIEVED_EXPIRY_S)


def _read_record(backend: Backend, rel: str) -> dict[str, Any] | None:
    """The JSON object stored at `rel` (a lease record, a heartbeat), or None where it is
    not one: not JSON, beyond the bounds of `canonical_json.load_bounded` (nested too
    deep, a number too long), not a regular file, or a link out of the store.

    Raises:
        FileNotFoundError: there is none.
    """
    try:
        doc = load_bounded(backend.read_bytes(rel))
    except (ValueError, StoreError):  # JSONDecodeError and UnsafeFileError included
        return None
    return doc if isinstance(doc, dict) else None


def _last_renewal(backend: Backend, gen: int, rec: dict[str, Any], now: float) -> float | None:
    """The newest of the record's acquisition time and its heartbeat's renewal time that
    is believable: a time later than one expiry from now was never written by a clock
    that agrees with ours (the hosts' clocks must agree to well within the expiry), and
    would keep the lease alive for ever."""
    times = [_number(rec.get("renewed"))]
    try:
        beat = _read_record(backend, lease_heartbeat_path(gen))
    except FileNotFoundError:
        beat = None  # no renewal yet: the record's time counts (a damaged one: likewise)
    if beat is not None and beat.get("generation") == gen:
        times.append(_number(beat.get("renewed")))
    expiry = _expiry(rec)
    horizon = now + (DEFAULT_LEASE_EXPIRY_S if expiry is None else expiry)
    known = [t for t in times if t is not None and t <= horizon]
    return max(known) if known else None


def current_holder(backend: Backend) -> dict[str, Any] | None:
    """The newest lease record, read without caches, or None when no lease was ever taken.

    Besides the record's own fields (owner, generation, host, pid, acquired, expiry_s)
    it holds `released` (bool), `renewed` (Unix seconds of the last renewal) and
    `expires` (Unix seconds; None for a lease written without an expiry).

    Raises:
        DamagedLeaseError: the newest lease record is not one.
    """
    gens = _generations(backend)
    if not gens:
        return None
    gen = gens[-1]
    try:
        rec = _read_record(backend, lease_path(gen))
    except FileNotFoundError:
        rec = None  # gone since the listing
    if rec is None or rec.get("generation") != gen:
        raise DamagedLeaseError(
            f"{backend.url}: {lease_path(gen)} is not a lease record of generation {gen}; "
            "the store's lease state is damaged. If no job writes to this store, take the "
            "lease over with takeover=True (CLI: --takeover), or move that file away",
            generation=gen,
        )
    rec["released"] = backend.exists(lease_released_path(gen))
    expiry = _expiry(rec)
    stated, now = rec.get("renewed"), time.time()
    renewed = _last_renewal(backend, gen, rec, now)
    rec["renewed"] = renewed
    if renewed is None and expiry is not None:
        # no believable renewal time (`renewed: 1e308`): expired, not alive for ever
        rec["unbelievable_renewal"] = stated
        rec["expires"] = now
    else:
        rec["expires"] = None if expiry is None or renewed is None else renewed + expiry
    return rec


class DamagedLeaseError(StoreError):
    """The newest lease record is not one (not JSON, beyond bounds, of another
    generation, not a regular file). `acquire_lease(takeover=True)` takes the store over
    from it.

    Attributes:
        generation: the damaged record's generation.
    """

    def __init__(self, message: str, *, generation: int) -> None:
        super().__init__(message)
        self.generation = generation


def _seconds(value: float) -> str:
    """A duration for a message: whole seconds, never negative."""
    return f"{max(value, 0.0):.0f} s"


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
        ago = now - rec["renewed"]
        renewed = f"renewed {_seconds(ago)} ago" if ago >= 0 else "renewed just now by its clock"
        why = (
            f", on host {rec.get('host')}, {renewed}; it expires in "
            f"{_seconds(rec['expires'] - now)} unless renewed)"
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
        DamagedLeaseError: the newest lease record is damaged (and not `takeover`).
    """
    if _number(expiry_s) is None or not expiry_s > 0:
        raise ValueError(
            f"lease expiry_s={expiry_s!r} must be a finite number of seconds > 0 "
            f"(default {DEFAULT_LEASE_EXPIRY_S:g})"
        )
    try:
        rec = current_holder(backend)
    except DamagedLeaseError as exc:
        if not takeover:
            raise
        log.warning("%s; taking the store over from it", exc)
        rec = {"generation": exc.generation, "released": True}
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
        elif rec.get("unbelievable_renewal") is not None and not rec.get("released"):
            log.warning(
                "%s: lease generation %d of writer %s records no believable renewal time "
                "(%r lies beyond its expiry from now); taking it",
                backend.url,
                gen,
                rec.get("owner"),
                rec["unbelievable_renewal"],
            )
        elif not rec.get("released") and rec.get("expires") is not None:
            left = rec["expires"] - now
            log.warning(
                "%s: lease generation %d of writer %s %s; taking it",
                backend.url,
                gen,
                rec.get("owner"),
                f"expired {_seconds(-left)} ago"
                if left <= 0
                else f"is gone (its process ended {_seconds(left)} before its lease expires)",
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
