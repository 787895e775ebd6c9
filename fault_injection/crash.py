"""Crash points: raise in-process, or SIGKILL the process for the real thing."""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping
from typing import Any, Literal

from state import hooks

__all__ = [
    "ENV_VAR",
    "CrashPointHit",
    "arm_from_env",
    "crash_at",
    "disarm_all",
    "known_points",
]

#: `COCOON_CRASH_AT="checkpoint.after_arrays:step=20"` arms a SIGKILL in a subprocess;
#: `...:step=20:stop` freezes it there instead (SIGSTOP).
ENV_VAR = "COCOON_CRASH_AT"


class CrashPointHit(BaseException):
    """Raised at an armed crash point in `mode="raise"`. A BaseException, so the code
    under test cannot swallow it with `except Exception` and carry on."""

    def __init__(self, name: str, ctx: Mapping[str, Any]) -> None:
        super().__init__(f"crash point {name} hit with {dict(ctx)}")
        self.name = name
        self.ctx = dict(ctx)


#: The modules that declare crash points beyond `state`'s own (at import).
_DECLARING_MODULES = (
    "cocoon_ckpt.dp.noise",
    "cocoon_ckpt.embedding.precompute",
    "cocoon_ckpt.embedding.stored_tiles",
    "cocoon_ckpt.train.trainer",
    "cocoon_ckpt.train.checkpoint",
)


def known_points() -> dict[str, str]:
    """Every crash point, name -> where it sits: the modules that declare them are
    imported first (a point is declared by the module that calls it, at import)."""
    import importlib

    for module in _DECLARING_MODULES:
        importlib.import_module(module)
    return dict(hooks.KNOWN_POINTS)


def crash_at(
    name: str,
    *,
    step: int | None = None,
    mode: Literal["raise", "kill", "stop"] = "raise",
    after_hits: int = 0,
) -> None:
    """Arm crash point `name`: the first hit (after `after_hits` earlier ones) whose
    step matches (any step when None) raises CrashPointHit, with `mode="kill"`
    SIGKILLs this process, or with `mode="stop"` freezes it (SIGSTOP: a GC pause, a
    frozen VM; it goes on where it stood after SIGCONT). Disarms itself once fired.

    Raises:
        KeyError: `name` is not a known crash point (state.hooks.KNOWN_POINTS).
    """
    if mode not in ("raise", "kill", "stop"):
        raise ValueError(f"crash_at mode={mode!r} must be 'raise', 'kill' or 'stop'")
    if name not in hooks.KNOWN_POINTS:
        known_points()  # armed before the job's modules were imported (a subprocess's env)
    remaining = [after_hits]

    def handler(point_name: str, ctx: Mapping[str, Any]) -> None:
        if step is not None and ctx.get("step") != step:
            return
        if remaining[0] > 0:
            remaining[0] -= 1
            return
        hooks.disarm(point_name)
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
            return
        raise CrashPointHit(point_name, ctx)

    hooks.arm(name, handler)


def disarm_all() -> None:
    """Remove every armed crash point."""
    hooks.disarm_all()


def arm_from_env(environ: Mapping[str, str] | None = None) -> list[str]:
    """Arm crash points listed in COCOON_CRASH_AT (`name[:step=N][:stop]`, comma
    separated): SIGKILL there, or with `:stop` freeze the process there (SIGSTOP).
    Returns the names armed."""
    spec = (environ if environ is not None else os.environ).get(ENV_VAR, "")
    armed = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, *args = item.split(":")
        step, mode = None, "kill"
        for arg in args:
            if arg == "stop":
                mode = "stop"
            elif arg.startswith("step="):
                step = int(arg.removeprefix("step="))
            else:
                raise ValueError(f"{ENV_VAR}: {item!r} has {arg!r}; expected step=N or stop")
        crash_at(name, step=step, mode=mode)  # type: ignore[arg-type]
        armed.append(name)
    return armed
