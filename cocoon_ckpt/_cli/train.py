"""`cocoon-ckpt train`: run a resumable private job, or resume it (the same command)."""

from __future__ import annotations

import argparse
import json
import os
from typing import TYPE_CHECKING, Any

from cocoon_ckpt._cli.args import add_json, add_storage_options, storage_options
from cocoon_ckpt._cli.train_config import (
    EXAMPLE_NAMES,
    add_target_flags,
    field_default,
    flag_default,
    train_job,
)
from cocoon_ckpt.dp.mechanism import MechanismKind
from cocoon_ckpt.errors import ConfigError
from cocoon_ckpt.train.config import CLIPPINGS, NOISE_RNGS, OPTIMIZERS, JobConfig
from state.canonical_json import load_bounded

if TYPE_CHECKING:
    from cocoon_ckpt._cli.args import Subparsers

__all__ = ["add_parser", "job_options", "run"]


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
        choices=list(EXAMPLE_NAMES),
        default=None,
        help="a built-in example job (default: mlp; --job example:NAME is the same)",
    )
    which.add_argument(
        "--job",
        default=None,
        metavar="MODULE:FUNCTION",
        help="your own job: a function of the JobConfig returning JobParts, in a module "
        "found in the current directory first (myjob.py: --job myjob:build), then on "
        "sys.path",
    )
    which.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="the whole job as JSON (the 'config' that `inspect URL --version V --json` "
        "prints); replaces the job and privacy flags below",
    )
    p.add_argument(
        "--job-option",
        action="append",
        default=None,
        metavar="KEY=VALUE",
        help="an entry of JobConfig.options the job reads (repeatable; part of the "
        "fingerprint, so a resume must give the same): VALUE is JSON where it parses "
        "(32, 0.5, true, [1,2]), else a string",
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
    add_target_flags(p)
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
    p.add_argument(
        "--clipping",
        choices=CLIPPINGS,
        help="how per-sample gradients are clipped: vmap forms them chunk by chunk; ghost "
        "forms none for Linear, LayerNorm and Embedding layers (norms and the clipped sum "
        f"from activations and output gradients, one backward) {_default('clipping')}",
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
        "--csc-window-steps",
        type=int,
        default=None,
        metavar="STEPS",
        help="read each coalesced table's committed CSC from the store in windows of this "
        "many steps, the next one read ahead (at most two in memory), so the CSC need not "
        "fit in RAM (default: held whole). The same bits either way: a resume may change it",
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
        "--allow-generator-change",
        action="store_true",
        help="resume although the store's noise came from another build of the noise "
        "generator (other numpy/torch releases, or the retired v1 scheme): the noise "
        "goes on, but no longer bit-identical to an uninterrupted run",
    )
    p.add_argument(
        "--allow-device-change",
        action="store_true",
        help="resume on another device type than the store's (the noise is the same; the "
        "gradients' last bits, so bit-exact resume, are not)",
    )
    p.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        help="resume from a version without a MAC under the job's key (one written before "
        "store format 4); its next version is authenticated",
    )
    p.add_argument(
        "--overlap-noise",
        action="store_true",
        help="compute each step's noise in a thread while the per-sample gradients are "
        "taken (bit-identical either way; may change on resume)",
    )
    p.add_argument(
        "--grad-threads",
        type=int,
        default=None,
        metavar="N",
        help="torch threads for the per-sample gradients, clipping and optimizer step "
        "(default for a new job: 1 below 262,144 dense parameters, torch's count from "
        "there; a resume keeps the job's recorded count, on any machine)",
    )
    p.add_argument(
        "--sync-checkpoints",
        action="store_true",
        help="write checkpoints in the foreground (default: background thread)",
    )
    p.add_argument(
        "--lent-rows",
        choices=["copy", "wait"],
        default="wait",
        help="when a step must overwrite a ring row the background checkpoint has not "
        "written yet: wait for the writer, which writes it next (default; no copy "
        "unless the writer has not begun it within 2 s) or copy it out (one row of "
        "memory, no wait for the disk). The same bytes are stored either way",
    )
    p.add_argument(
        "--lease-expiry",
        type=float,
        default=None,
        metavar="SECONDS",
        help="the writer lease of a holder on another host counts as dead this long after "
        f"its last renewal (default {field_default(JobConfig, 'lease_expiry_s')})",
    )
    p.add_argument(
        "--quiet",
        "--no-progress",
        dest="no_progress",
        action="store_true",
        help="no progress on stderr: neither the bar (on a terminal) nor the line per "
        "checkpoint (otherwise)",
    )
    add_json(p, "result")


def _option_value(text: str) -> Any:
    """VALUE of --job-option: JSON where it parses within the bounds a record is read
    with (`state.canonical_json.load_bounded`: finite numbers, as NaN never equals itself
    and a resume could never match the stored options; numbers of at most 100
    characters; at most 128 levels), else the text."""
    try:
        return load_bounded(text)
    except ValueError:  # JSONDecodeError included
        return text


def job_options(pairs: list[str] | None) -> dict[str, Any]:
    """The JobConfig.options that repeated `--job-option KEY=VALUE` give.

    Raises:
        ConfigError: an entry has no `=` or an empty key, or a key is given twice.
    """
    options: dict[str, Any] = {}
    for pair in pairs or ():
        key, eq, text = pair.partition("=")
        if not eq or not key.strip():
            raise ConfigError(
                f"--job-option {pair!r} is not KEY=VALUE; write it as e.g. --job-option hidden=32"
            )
        if key in options:
            raise ConfigError(
                f"--job-option {key} is given twice ({key}={json.dumps(options[key])} and "
                f"{pair}); give each key once"
            )
        options[key] = _option_value(text)
    return options


def run(args: argparse.Namespace) -> int:
    """Run (or resume) the job the flags describe; print its result. Exit 0."""
    if args.job_option and args.config is not None:
        raise ConfigError(
            "--config sets the whole job, its options included; drop --job-option, or "
            "set them in the file's 'options'"
        )
    options = job_options(args.job_option)
    # A job the user named (--job, or the file of --config) is looked for in the current
    # directory first, as `python -m` would; the console script has no cwd on sys.path.
    # A --job is built here once: its objects say what its optimizer, lr and dataset size
    # are (train_config.train_job).
    config, store, parts = train_job(args, options)
    # under torchrun every rank runs this; rank 0 alone shows progress and the result
    follower = os.environ.get("RANK", "0") != "0"
    progress = None
    if not args.no_progress and not follower:
        from cocoon_ckpt._cli.progress import Progress

        progress = Progress(
            config.dp.steps,
            config.checkpoint_every,
            store=store,
            job=config.job,
            storage_options=storage_options(args),
        )

    from cocoon_ckpt.train.allowances import ResumeAllowances
    from cocoon_ckpt.train.options import JobOptions
    from cocoon_ckpt.train.runner import run_job

    allow = ResumeAllowances(
        fallback=args.allow_fallback,
        device_change=args.allow_device_change,
        generator_change=args.allow_generator_change,
        unauthenticated=args.allow_unauthenticated,
    )
    run_options = JobOptions(
        key_file=args.key_file,
        storage_options=storage_options(args),
        takeover=args.takeover,
        allow=allow,
        on_precompute=None if progress is None else progress.on_precompute,
        lent_rows=args.lent_rows,
    )
    try:
        result = run_job(
            config,
            store,
            parts,
            options=run_options,
            on_step=None if progress is None else progress.on_step,
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
