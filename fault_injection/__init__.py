"""fault_injection: arm the library's named crash points (in-process raise or SIGKILL)."""

from .crash import CrashPointHit, arm_from_env, crash_at, disarm_all
from .faulty_fs import FaultPlan, FaultyFileSystem, faulty_filesystem

__all__ = [
    "CrashPointHit",
    "FaultPlan",
    "FaultyFileSystem",
    "arm_from_env",
    "crash_at",
    "disarm_all",
    "faulty_filesystem",
]
