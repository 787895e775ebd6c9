"""fault_injection: crash points (raise or SIGKILL), faulty:// storage, and the golden-run
comparator that proves a faulted, resumed run adds exactly the noise of an uninterrupted one."""

from .chaos import (
    ChaosReport,
    local_s3_server,
    run_chaos,
    run_kill_chaos,
    run_takeover_chaos,
)
from .crash import CrashPointHit, arm_from_env, crash_at, disarm_all
from .faulty_fs import FaultPlan, FaultyFileSystem, faulty_filesystem
from .golden import Divergence, StepTrace, Trace, golden, verify

__all__ = [
    "ChaosReport",
    "CrashPointHit",
    "Divergence",
    "FaultPlan",
    "FaultyFileSystem",
    "StepTrace",
    "Trace",
    "arm_from_env",
    "crash_at",
    "disarm_all",
    "faulty_filesystem",
    "golden",
    "local_s3_server",
    "run_chaos",
    "run_kill_chaos",
    "run_takeover_chaos",
    "verify",
]
