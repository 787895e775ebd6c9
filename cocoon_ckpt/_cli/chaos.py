"""`cocoon-ckpt chaos` and the crash points of kill tests: the only module of
cocoon_ckpt that imports fault_injection (always inside a function, so no other command
loads it)."""

from __future__ import annotations

import argparse
import json
import logging
import os
from typing import TYPE_CHECKING

from cocoon_ckpt._cli.args import add_json
from cocoon_ckpt.errors import ConfigError
from cocoon_ckpt.train.config import DPConfig, JobConfig

if TYPE_CHECKING:
    from cocoon_ckpt._cli.args import Subparsers

__all__ = ["CRASH_ENV", "add_parser", "arm_crash_points", "run"]

#: The environment variable that arms a crash point in a `cocoon-ckpt` process.
CRASH_ENV = "COCOON_CRASH_AT"

#: The chaos job's data: small enough for hundreds of runs, the same in-process and in
#: the subprocesses of kill and takeover trials.
_BATCH_SIZE = 16
_DATASET_SIZE = 512


def arm_crash_points() -> None:
    """Arm the crash point CRASH_ENV names, for kill tests; without it nothing is armed
    (and fault_injection is not imported)."""
    if os.environ.get(CRASH_ENV):
        from fault_injection.crash import arm_from_env

        arm_from_env()


def add_parser(sub: Subparsers) -> None:
    """Add `chaos` to the top-level subcommands."""
    p = sub.add_parser(
        "chaos",
        help="random crash schedules on faulty storage, each compared with a golden run",
        description="Draw N random fault schedules (crash points at random steps, transient "
        "storage errors, lost responses, slow writes; at rest: bit flips in chunks and "
        "manifests, array paths pointed out of the store with re-stamped checksums), run each "
        "to completion with resumes on a faulty memory:// store, and compare every step with "
        "an uninterrupted run; then run --kill-trials real subprocesses SIGKILLed at a crash "
        "point and at random moments, and --takeover-trials writers frozen on a local S3 "
        "server while another takes over, and compare their final models. Exit 1 if anything "
        "diverged, was lost, went undetected or a superseded writer committed.",
    )
    p.set_defaults(handler=run)
    p.add_argument("--example", choices=["mlp", "dlrm"], default="mlp", help="(default mlp)")
    p.add_argument("--trials", type=int, default=200, help="schedules to draw (default 200)")
    p.add_argument("--seed", type=int, default=0, help="seed of the schedules (default 0)")
    p.add_argument("--steps", type=int, default=24, help="steps per run (default 24)")
    p.add_argument("--bands", type=int, default=8, help="BandMF bands (default 8)")
    p.add_argument("--checkpoint-every", type=int, default=5, help="(default 5)")
    p.add_argument(
        "--kill-trials",
        type=int,
        default=10,
        help="also run this many trials as real subprocesses SIGKILLed at a crash point "
        "and at random moments, and sent SIGTERM to their process group once (a scheduler's "
        "preemption: exit 143 with the step committed, the lease released), on local disk "
        "(default 10; each takes seconds)",
    )
    p.add_argument(
        "--takeover-trials",
        type=int,
        default=None,
        help="also run this many takeovers on a local S3 server (moto, in the test extra): "
        "a writer frozen mid-run, a second one taking over with --takeover, the first "
        "woken and fenced (default 2 where moto is installed, else 0)",
    )
    add_json(p, "report")


def _check(args: argparse.Namespace) -> int:
    """The number of takeover trials, once the trial counts are checked.

    Raises:
        ValueError: a trial count out of range (a usage error, exit 2).
    """
    if args.trials < 1:
        raise ConfigError(f"--trials={args.trials} must be >= 1")
    if args.kill_trials < 0:
        raise ConfigError(f"--kill-trials={args.kill_trials} must be >= 0")
    if args.takeover_trials is not None and args.takeover_trials < 0:
        raise ConfigError(f"--takeover-trials={args.takeover_trials} must be >= 0")
    if args.takeover_trials is not None:
        return int(args.takeover_trials)
    import importlib.util

    return 2 if importlib.util.find_spec("moto") is not None else 0


def run(args: argparse.Namespace) -> int:
    """Run the chaos trials and print the report. Exit 0 when nothing went wrong, else 1."""
    takeovers = _check(args)
    from fault_injection import run_chaos, run_kill_chaos

    config = JobConfig(
        job=f"example:{args.example}",
        dp=DPConfig(
            steps=args.steps,
            batch_size=_BATCH_SIZE,
            dataset_size=_DATASET_SIZE,
            noise_multiplier=1.0,
            bands=args.bands,
        ),
        options={"tables": [200, 100, 50], "dim": 4} if args.example == "dlrm" else {},
        checkpoint_every=args.checkpoint_every,
    )
    # Every skipped damaged version and retried error is counted in the report.
    logging.getLogger("state").setLevel(logging.ERROR)
    report = run_chaos(config, trials=args.trials, seed=args.seed)
    # the same job as a `train` command line, for the subprocess trials
    train_args = [
        *("--example", args.example, "--steps", str(args.steps), "--bands", str(args.bands)),
        *("--checkpoint-every", str(args.checkpoint_every)),
        *("--batch-size", str(_BATCH_SIZE), "--dataset-size", str(_DATASET_SIZE)),
    ]
    if args.kill_trials:
        run_kill_chaos(train_args, trials=args.kill_trials, seed=args.seed, report=report)
    if takeovers:
        from fault_injection import local_s3_server, run_takeover_chaos

        server, opts, bucket = local_s3_server()
        try:
            run_takeover_chaos(
                train_args,
                trials=takeovers,
                seed=args.seed,
                storage_options=opts,
                bucket=bucket,
                steps=args.steps,
                checkpoint_every=args.checkpoint_every,
                report=report,
            )
        finally:
            server.stop()
    if args.json:
        print(json.dumps(report.as_json()))
    else:
        print(report.table())
        for line in report.failures:
            print(f"FAILED {line}")
    return 0 if report.ok else 1
