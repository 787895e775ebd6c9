"""fault_injection: arm the library's named crash points (in-process raise or SIGKILL)."""

from .crash import CrashPointHit, arm_from_env, crash_at, disarm_all

__all__ = ["CrashPointHit", "arm_from_env", "crash_at", "disarm_all"]
