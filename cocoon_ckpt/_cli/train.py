"""`cocoon-ckpt train`: run a resumable private job, or resume it (the same command)."""

from __future__ import annotations

import argparse
import json
import os
from typing import TYPE_CHECKING

from cocoon_ckpt._cli.args import add_json, add_storage_options, storage_options
from cocoon_ckpt._cli.train_config import field_default, flag_default, train_config
from cocoon_ckpt.dp.mechanism import MechanismKind
from cocoon_ckpt.train.config import NOISE_RNGS, OPTIMIZERS, JobConfig

if TYPE_CHECKING:
    from cocoon_ckpt._cli.args import Subparsers

__all__ = ["add_parser", "run"]


def _default(flag: str) -> str:
    return f"(default {flag_default(flag)})"


def add_parser(sub: Subparsers) -> None:
    """Add `train` and its flags to the top-level subcommands."""
    p = sub.add_parser(
        "train",
        help="run a resumable private job (rerun the same command to resume it)",
        description="Train with b-banded correlated noise, checkpointing every K steps. "
        "Running the same command again against the same store resumes from the newest "
        "valid version and ends bit-identical to an uninterrupted run.",
    )
    p.set_defaults(handler=run)
    which = p.add_mutually_exclusive_group()
    which.add_argument(
        "--example",
        choices=["mlp", "dlrm"],
        default=None,
        help="a built-in example job (default: mlp)",
    )
    which.add_argument(
        "--job", default=None, help="your own job as module:function returning JobParts"
    )
    which.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="the whole job as JSON (the 'config' that `inspect URL --version V --json` "
        "prints); replaces the job and privacy flags below",
    )
    p.add_argument(
        "--store",
        default=None,
        help="store URL: local path, memory://, s3://... (default: runs/<example>.zarr)",
    )
    # Job flags default to None, so --config can tell which were given; train_config
    # fills in what is not given from the config dataclasses.
    p.add_argument("--steps", type=int, help=f"total training steps n {_default('steps')}")
    p.add_argument(
        "--checkpoint-every",
        type=int,
        help="steps between checkpoints K "
        f"(default {field_default(JobConfig, 'checkpoint_every')})",
    )
    p.add_argument("--seed", type=int, help=f"sampler and init seed {_default('seed')}")
    p.add_argument("--bands", type=int, help=f"BandMF bands b; 1 = DP-SGD {_default('bands')}")
    p.add_argument("--batch-size", type=int, help=f"expected batch size B {_default('batch_size')}")
    p.add_argument(
        "--physical-batch-size",
        type=int,
        help="most examples whose per-sample gradients are taken at once (peak memory "
        "follows it; None: the whole batch at once); part of the fingerprint "
        f"{_default('physical_batch_size')}",
    )
    p.add_argument(
        "--dataset-size",
        type=int,
        help=f"examples N in the synthetic dataset {_default('dataset_size')}",
    )
    p.add_argument(
        "--noise-multiplier",
        type=float,
        help=f"sigma; fresh noise std = sigma * clip {_default('noise_multiplier')}",
    )
    p.add_argument("--clip", type=float, help=f"per-sample L2 clip norm {_default('clip')}")
    p.add_argument("--delta", type=float, help=f"delta of reported epsilon {_default('delta')}")
    p.add_argument(
        "--mechanism",
        choices=[m.value for m in MechanismKind if m is not MechanismKind.CUSTOM],
        help=f"band coefficients {_default('mechanism')}",
    )
    p.add_argument(
        "--noise-rng",
        choices=NOISE_RNGS,
        help="generator of the fresh noise: numpy SFC64, or ChaCha20 (secure, needs the "
        f"cryptography package) {_default('noise_rng')}",
    )
    p.add_argument("--lr", type=float, help=f"learning rate {_default('lr')}")
    p.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        metavar="NAME",
        help=f"a torch.optim optimizer in lower case (sgd, adam, adamw, ...), or custom for "
        f"a job's own class {_default('optimizer')}",
    )
    p.add_argument(
        "--key-file",
        default=None,
        help="keep the secret noise key in this file (0600) instead of the store",
    )
    add_storage_options(p)
    p.add_argument(
        "--tiers",
        default=None,
        metavar="JSON",
        help="where the noise history lives, as TierConfig fields in JSON, e.g. "
        '\'{"host_bytes": 268435456, "far_bytes": 1073741824, "far_dir": "/dev/shm", '
        '"far_link_bytes_per_s": 5e9}\' (bytes; default: all on the host). Changing it on '
        "resume is allowed: the noise is bit-identical on any tiers",
    )
    p.add_argument(
        "--embedding",
        choices=["auto", "dense", "coalesced", "lazy"],
        default=None,
        help="noise path of the job's embedding tables (dlrm): per-row gradients and "
        "dense online noise, or coalesced precomputed noise with a hot/cold split, or lazy "
        "noise at b=1; coalesced and lazy need --threat-model final_model (default: the "
        "tables are part of the dense noise vector)",
    )
    p.add_argument(
        "--threat-model",
        choices=["intermediate_iterates", "final_model"],
        default=None,
        help="final_model: only the exported final model is private (intermediate "
        "checkpoints lack cold rows' pending noise); allows coalescing",
    )
    p.add_argument(
        "--hot-threshold",
        type=int,
        default=None,
        help="rows read more than this many times keep online history (default: chosen "
        "from a quick profile)",
    )
    p.add_argument(
        "--takeover",
        action="store_true",
        help="take the writer lease even if its holder looks alive",
    )
    p.add_argument(
        "--allow-fallback",
        action="store_true",
        help="resume from an older version if the newest is damaged",
    )
    p.add_argument(
        "--overlap-noise",
        action="store_true",
        help="compute each step's noise in a thread while the per-sample gradients are "
        "taken (bit-identical either way; may change on resume)",
    )
    p.add_argument(
        "--sync-checkpoints",
        action="store_true",
        help="write checkpoints in the foreground (default: background thread)",
    )
    p.add_argument(
        "--lease-expiry",
        type=float,
        default=None,
        metavar="SECONDS",
        help="the writer lease of a holder on another host counts as dead this long after "
        f"its last renewal (default {field_default(JobConfig, 'lease_expiry_s')})",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_json(p, "result")


def run(args: argparse.Namespace) -> int:
    """Run (or resume) the job the flags describe; print its result. Exit 0."""
    config, store = train_config(args)
    # under torchrun every rank runs this; rank 0 alone shows progress and the result
    follower = os.environ.get("RANK", "0") != "0"
    progress = None
    if not args.no_progress and not follower:
        from cocoon_ckpt._cli.progress import Progress

        progress = Progress(config.dp.steps, config.checkpoint_every)

    from cocoon_ckpt.train.runner import run_job

    try:
        result = run_job(
            config,
            store,
            storage_options=storage_options(args),
            key_file=args.key_file,
            takeover=args.takeover,
            allow_fallback=args.allow_fallback,
            on_step=None if progress is None else progress.on_step,
            on_precompute=None if progress is None else progress.on_precompute,
        )
    finally:
        if progress is not None:
            progress.close()
    if follower:
        return 0
    if args.json:
        out = {
            "store": store,
            "steps": result.steps_done,
            "resumed_from": result.resumed_from,
            "epsilon": result.epsilon,
            "delta": config.dp.delta,
            "version": result.version,
        }
        print(json.dumps(out))
    else:
        resumed = (
            "" if result.resumed_from is None else f" (resumed from step {result.resumed_from})"
        )
        print(
            f"done: {result.steps_done} steps{resumed}, epsilon={result.epsilon:.4f} at "
            f"delta={config.dp.delta:g}, version {result.version} in {store}"
        )
    return 0
