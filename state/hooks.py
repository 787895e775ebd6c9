"""Named crash points: a tiny registry every layer calls, armed only by `fault_injection`.

`point(name, **ctx)` is a dictionary lookup on an empty dict unless a fault is armed,
so the points cost nothing in production, and the package arrow
(`state` <- `cocoon_ckpt` <- `fault_injection`) holds: lower layers never import the
injector, the injector arms hooks here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["KNOWN_POINTS", "arm", "armed", "disarm", "disarm_all", "point"]

Handler = Callable[[str, Mapping[str, Any]], None]

#: Every crash point the library calls, with where it sits.
KNOWN_POINTS: dict[str, str] = {
    "noise.before_fresh": "before fresh noise z_t is drawn",
    "noise.after_fresh": "after z_t is drawn, before the GEMV",
    "noise.after_gemv": "after the history GEMV, before the ring is updated",
    "trainer.after_update": "after the optimizer step of step t",
    "checkpoint.before_array": "before one array of a version is written",
    "checkpoint.after_array": "after one array of a version is written",
    "checkpoint.after_arrays": "after every array of a version is durable",
    "checkpoint.shard_done": "multi-process: a rank's arrays are durable, before the barrier",
    "checkpoint.before_manifest": "before the manifest (commit record) is written",
    "checkpoint.after_manifest_temp": "local disk: temp manifest durable, not yet linked",
    "checkpoint.after_manifest": "after the manifest is visible (committed)",
    "checkpoint.async_flush": "in the background writer, before it starts a version",
    "retention.before_delete": "before retention deletes one unreferenced path",
}

_armed: dict[str, Handler] = {}


def point(point_name: str, /, **ctx: Any) -> None:
    """Mark a crash point. A no-op unless `fault_injection` armed `name`.

    Args:
        point_name: one of `KNOWN_POINTS`.
        **ctx: what the handler may match on (step, version, path, ...).
    """
    if _armed:
        handler = _armed.get(point_name)
        if handler is not None:
            handler(point_name, ctx)


def arm(name: str, handler: Handler) -> None:
    """Install `handler` at crash point `name` (replacing any handler there).

    Raises:
        KeyError: `name` is not a known crash point.
    """
    if name not in KNOWN_POINTS:
        raise KeyError(f"unknown crash point {name!r}; known points: {sorted(KNOWN_POINTS)}")
    _armed[name] = handler


def disarm(name: str) -> None:
    """Remove the handler at `name`, if any."""
    _armed.pop(name, None)


def disarm_all() -> None:
    """Remove every handler."""
    _armed.clear()


def armed() -> list[str]:
    """Names of the points that have a handler now."""
    return sorted(_armed)
