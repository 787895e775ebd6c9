"""fault_injection: crash points (raise or SIGKILL), faulty:// storage, and the golden-run
comparator that proves a faulted, resumed run adds exactly the noise of an uninterrupted one."""

from typing import TYPE_CHECKING

from cocoon_ckpt._lazy import attach

if TYPE_CHECKING:  # the names as static tools see them
    from .chaos import ChaosReport, run_chaos
    from .crash import CrashPointHit, arm_from_env, crash_at, disarm_all, known_points
    from .faulty_fs import FaultPlan, FaultyFileSystem, faulty_filesystem
    from .process_chaos import local_s3_server, run_kill_chaos, run_takeover_chaos
    from .trace import Divergence, StepTrace, Trace, golden, verify

# Names load on first use (PEP 562): the pytest plugin (entry point pytest11) imports this
# package in every pytest run of the environment, which must not pay for torch and zarr.
# No submodule may share a name it exports: once imported, a submodule is bound as the
# package's attribute and would shadow the lazy name (a module `golden` hid `golden()`).
_LAZY = {
    "ChaosReport": "chaos",
    "CrashPointHit": "crash",
    "Divergence": "trace",
    "FaultPlan": "faulty_fs",
    "FaultyFileSystem": "faulty_fs",
    "StepTrace": "trace",
    "Trace": "trace",
    "arm_from_env": "crash",
    "crash_at": "crash",
    "disarm_all": "crash",
    "faulty_filesystem": "faulty_fs",
    "golden": "trace",
    "known_points": "crash",
    "local_s3_server": "process_chaos",
    "run_chaos": "chaos",
    "run_kill_chaos": "process_chaos",
    "run_takeover_chaos": "process_chaos",
    "verify": "trace",
}

__getattr__, __dir__ = attach(__name__, _LAZY)

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
    "known_points",
    "local_s3_server",
    "run_chaos",
    "run_kill_chaos",
    "run_takeover_chaos",
    "verify",
]
