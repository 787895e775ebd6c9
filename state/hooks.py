"""Named crash points: a tiny registry every layer calls, armed only by `fault_injection`.

`point(name, **ctx)` is a dictionary lookup on an empty dict unless a fault is armed,
so the points cost nothing in production, and the package arrow
(`state` <- `cocoon_ckpt` <- `fault_injection`) holds: lower layers never import the
injector, the injector arms hooks here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["KNOWN_POINTS", "Handler", "arm", "armed", "declare", "disarm", "disarm_all", "point"]

Handler = Callable[[str, Mapping[str, Any]], None]

#: Every crash point declared so far, with where it sits. Each module declares its own
#: points at import (`declare`), so the registry is complete once the modules that call
#: them are imported (`fault_injection` imports the engine before drawing from it).
KNOWN_POINTS: dict[str, str] = {}

_armed: dict[str, Handler] = {}


def declare(name: str, description: str) -> str:
    """Declare crash point `name` (called once, at import, by the module that calls it).

    Args:
        name: `<area>.<moment>`, e.g. `checkpoint.before_manifest`.
        description: where the point sits, for listings and chaos reports.

    Returns:
        `name`, so a module can keep it as a constant.

    Raises:
        ValueError: `name` is already declared with another description (two modules
            claim the same point).
    """
    known = KNOWN_POINTS.get(name)
    if known is not None and known != description:
        raise ValueError(
            f"crash point {name!r} is already declared as {known!r}; a point has one "
            "owner: pick another name"
        )
    KNOWN_POINTS[name] = description
    return name


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
        KeyError: `name` is not a declared crash point (the module that declares it is
            not imported, or the name is wrong).
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
