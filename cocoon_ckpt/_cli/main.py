"""`cocoon-ckpt`: the command line above all three packages (a thin layer over the API)."""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import sys
import traceback
from collections.abc import Sequence
from typing import Any, NoReturn, cast

from cocoon_ckpt._version import VersionAction
from cocoon_ckpt.dp.mechanism import MechanismKind
from cocoon_ckpt.errors import CocoonError, ConfigError, NoiseKeyError, PreemptedError
from cocoon_ckpt.tiers.config import TierConfig
from cocoon_ckpt.train.config import DPConfig, JobConfig, section_from_record
from state import (
    FormatVersionError,
    StoreError,
    StoreNotFoundError,
    VersionNotFoundError,
)

__all__ = ["main"]

_LOG_LEVELS = ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG")


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (exit 2), like every other error of the CLI."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"cocoon-ckpt: error: {message}; see {self.prog} --help\n")


def _log_level(value: str) -> str:
    if value.upper() not in _LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"{value!r} is not one of {', '.join(_LOG_LEVELS)}")
    return value.upper()


def _add_storage_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--storage-options",
        default=None,
        metavar="JSON",
        help="fsspec options for the store URL as a JSON object, e.g. "
        '\'{"endpoint_url": "http://127.0.0.1:5000"}\' for an S3-compatible endpoint',
    )


#: Types of the fsspec options users pass most (s3fs, gcsfs, adlfs): a string "false"
#: for `anon` would be truthy and silently change who the store is accessed as.
_OPTION_TYPES: dict[str, tuple[type, ...]] = {
    **dict.fromkeys(("anon", "use_ssl", "skip_instance_cache", "use_listings_cache"), (bool,)),
    **dict.fromkeys(("requester_pays", "version_aware", "auto_mkdir"), (bool,)),
    **dict.fromkeys(("endpoint_url", "key", "secret", "token", "profile"), (str,)),
    **dict.fromkeys(("region_name", "account_name", "account_key", "project"), (str,)),
    **dict.fromkeys(("client_kwargs", "config_kwargs", "s3_additional_kwargs"), (dict,)),
}


def _storage_options(args: argparse.Namespace) -> dict[str, Any] | None:
    if args.storage_options is None:
        return None
    try:
        opts = json.loads(args.storage_options)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"--storage-options is not valid JSON ({exc}); pass a JSON object"
        ) from None
    if not isinstance(opts, dict):
        raise ConfigError("--storage-options must be a JSON object, e.g. '{\"anon\": false}'")
    for k, v in opts.items():
        types = _OPTION_TYPES.get(k)
        if types is not None and not isinstance(v, types):
            raise ConfigError(
                f"--storage-options: {k}={json.dumps(v)} must be a JSON "
                f"{'/'.join({bool: 'boolean', str: 'string', dict: 'object'}[t] for t in types)}"
            )
    return opts


def _seed(text: str) -> int:
    """argparse type of a seed: an integer >= 0 (a usage error otherwise, exit 2)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative; a seed is an integer >= 0")
    return value


def _add_train(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "train",
        help="run a resumable private job (rerun the same command to resume it)",
        description="Train with b-banded correlated noise, checkpointing every K steps. "
        "Running the same command again against the same store resumes from the newest "
        "valid version and ends bit-identical to an uninterrupted run.",
    )
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
    p.add_argument("--steps", type=int, default=None, help="total training steps n (default 50)")
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=None,
        help="steps between checkpoints K (default 10)",
    )
    p.add_argument("--seed", type=int, default=None, help="sampler and init seed (default 0)")
    p.add_argument("--bands", type=int, default=None, help="BandMF bands b; 1 = DP-SGD (default 8)")
    p.add_argument(
        "--batch-size", type=int, default=None, help="expected batch size B (default 32)"
    )
    p.add_argument(
        "--dataset-size",
        type=int,
        default=None,
        help="examples N in the synthetic dataset (default 2048)",
    )
    p.add_argument(
        "--noise-multiplier",
        type=float,
        default=None,
        help="sigma; fresh noise std = sigma * clip (default 1.0)",
    )
    p.add_argument("--clip", type=float, default=None, help="per-sample L2 clip norm (default 1.0)")
    p.add_argument(
        "--delta", type=float, default=None, help="delta of reported epsilon (default 1e-5)"
    )
    p.add_argument(
        "--mechanism",
        choices=[m.value for m in MechanismKind if m is not MechanismKind.CUSTOM],
        default=None,
        help="band coefficients (default banded_sqrt)",
    )
    p.add_argument("--lr", type=float, default=None, help="learning rate (default 0.1)")
    p.add_argument("--optimizer", choices=["sgd", "adam"], default=None, help="(default sgd)")
    p.add_argument(
        "--key-file",
        default=None,
        help="keep the secret noise key in this file (0600) instead of the store",
    )
    _add_storage_options(p)
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
        f"its last renewal (default {JobConfig.__dataclass_fields__['lease_expiry_s'].default})",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def _add_export(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "export",
        help="write the final model (no noise state) and a privacy report",
        description="Write the finished job's model state_dict to OUT (torch.save) and "
        "its privacy report to OUT.privacy.json, both or neither. Finished means the "
        "verified step count equals the config's; epsilon is recomputed from the config. "
        "No noise key or history is exported.",
    )
    p.add_argument("url", help="store URL")
    p.add_argument(
        "--out",
        required=True,
        help="new output file for the state_dict, outside the store, in an existing folder",
    )
    _add_storage_options(p)
    p.add_argument("--json", action="store_true", help="print the privacy report as JSON")


def _add_inspect(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "inspect",
        help="list a store's versions: steps, sizes by kind, placement, threat model, epsilon",
        description="Read the manifests (no array is read) and describe every version: step, "
        "bytes written and referenced by kind (model, optimizer, ring, rng, csc), where the "
        "noise history lies, threat model and epsilon. With --version, that version's full "
        "config and array list.",
    )
    p.add_argument("url", help="store URL")
    p.add_argument("--version", type=int, default=None, help="describe only this version")
    _add_storage_options(p)
    p.add_argument("--json", action="store_true", help="print the description as JSON")


def _add_audit(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "audit",
        help="verify every checksum, regenerate the noise from the key, recompute epsilon",
        description="Check a store and change nothing: the manifest chain; every array's "
        "checksum; the stored ring slots against noise regenerated from the key at K random "
        "coordinates over all steps; epsilon recomputed from the recorded configuration; the "
        "config fingerprint and key id of every version; who can read the store; the threat "
        "model. Exit 0 when all holds, 1 with a list of findings, 2 on usage errors.",
    )
    p.add_argument("url", help="store URL")
    p.add_argument(
        "--coordinates",
        type=int,
        default=256,
        metavar="K",
        help="noise coordinates to regenerate over all steps (default 256; all if >= the "
        "model size)",
    )
    p.add_argument(
        "--key-file", default=None, help="the noise key, for a job that kept it outside the store"
    )
    p.add_argument(
        "--seed",
        type=_seed,
        default=None,
        help="seed of the coordinate choice, >= 0 (default: random, printed, so a run can be "
        "repeated)",
    )
    p.add_argument("--plot", default=None, metavar="DIR", help="also write PNG plots to DIR")
    which = p.add_mutually_exclusive_group()
    which.add_argument(
        "--job",
        default=None,
        metavar="MODULE:FUNCTION",
        help="the job whose data the embedding schedule checks need (audit never runs the "
        "job a store names; without --job/--example those checks are skipped and listed)",
    )
    which.add_argument(
        "--example",
        choices=["mlp", "dlrm"],
        default=None,
        help="a built-in example job, for the same checks",
    )
    _add_storage_options(p)
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def _add_diff(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "diff",
        help="what changed between two versions",
        description="Arrays added, removed, changed, shared by path, and every record field "
        "that differs between versions V1 and V2 (manifests only).",
    )
    p.add_argument("url", help="store URL")
    p.add_argument("v1", type=int, help="older version")
    p.add_argument("v2", type=int, help="newer version")
    _add_storage_options(p)
    p.add_argument("--json", action="store_true", help="print the diff as JSON")


def _add_gc(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "gc",
        help="delete all but the newest N versions and what nothing kept references",
        description="Keep the N newest versions (N >= 2) and the newest valid one; delete "
        "other manifests, unreferenced version folders and leftover .partial files. Takes the "
        "writer lease first, so it refuses while a job is writing.",
    )
    p.add_argument("url", help="store URL")
    p.add_argument("--keep", type=int, required=True, metavar="N", help="versions to keep (>= 2)")
    p.add_argument(
        "--takeover", action="store_true", help="take the lease even if its holder looks alive"
    )
    p.add_argument(
        "--discard-damaged",
        action="store_true",
        help="also delete versions whose manifest fails to verify and the arrays only they "
        "reference (without it a damaged manifest stops gc and nothing is deleted)",
    )
    _add_storage_options(p)
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def _add_chaos(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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
        "and at random moments, on local disk (default 10; each takes seconds)",
    )
    p.add_argument(
        "--takeover-trials",
        type=int,
        default=None,
        help="also run this many takeovers on a local S3 server (moto, in the test extra): "
        "a writer frozen mid-run, a second one taking over with --takeover, the first "
        "woken and fenced (default 2 where moto is installed, else 0)",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def _chaos(args: argparse.Namespace) -> int:
    from fault_injection import run_chaos, run_kill_chaos

    if args.trials < 1:
        raise ValueError(f"--trials={args.trials} must be >= 1")
    if args.kill_trials < 0:
        raise ValueError(f"--kill-trials={args.kill_trials} must be >= 0")
    if args.takeover_trials is not None and args.takeover_trials < 0:
        raise ValueError(f"--takeover-trials={args.takeover_trials} must be >= 0")
    takeovers = args.takeover_trials
    if takeovers is None:
        import importlib.util

        takeovers = 2 if importlib.util.find_spec("moto") is not None else 0
    config = JobConfig(
        job=f"example:{args.example}",
        dp=DPConfig(
            steps=args.steps,
            batch_size=16,
            dataset_size=512,
            noise_multiplier=1.0,
            bands=args.bands,
        ),
        options={"tables": [200, 100, 50], "dim": 4} if args.example == "dlrm" else {},
        checkpoint_every=args.checkpoint_every,
    )
    # Every skipped damaged version and retried error is counted in the report.
    logging.getLogger("state").setLevel(logging.ERROR)
    report = run_chaos(config, trials=args.trials, seed=args.seed)
    train_args = [
        *("--example", args.example, "--steps", str(args.steps), "--bands", str(args.bands)),
        *("--checkpoint-every", str(args.checkpoint_every), "--batch-size", "16"),
        *("--dataset-size", "512"),
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


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="cocoon-ckpt",
        description="Differentially private training with correlated noise that can crash "
        "anywhere and resume exactly.",
    )
    p.add_argument("--version", action=VersionAction)
    p.add_argument(
        "--log-level",
        default="WARNING",
        type=_log_level,
        metavar="LEVEL",
        help=f"logging level: {', '.join(_LOG_LEVELS)} (default WARNING; DEBUG also prints "
        "the traceback of an unexpected error)",
    )
    sub = cast(
        "argparse._SubParsersAction[argparse.ArgumentParser]",
        p.add_subparsers(dest="command", required=True),  # of _Parser: one-line errors too
    )
    _add_train(sub)
    _add_export(sub)
    _add_inspect(sub)
    _add_audit(sub)
    _add_diff(sub)
    _add_gc(sub)
    _add_chaos(sub)
    return p


#: The job and privacy flags of `train`, their defaults, and the JobConfig field each sets.
_TRAIN_FLAGS: dict[str, tuple[Any, str]] = {
    "steps": (50, "dp.steps"),
    "batch_size": (32, "dp.batch_size"),
    "dataset_size": (2048, "dp.dataset_size"),
    "noise_multiplier": (1.0, "dp.noise_multiplier"),
    "clip": (1.0, "dp.max_grad_norm"),
    "bands": (8, "dp.bands"),
    "delta": (1e-5, "dp.delta"),
    "mechanism": ("banded_sqrt", "dp.mechanism"),
    "seed": (0, "dp.seed"),
    "lr": (0.1, "lr"),
    "optimizer": ("sgd", "optimizer"),
}


def _read_config_file(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            doc = json.load(f)
    except OSError as exc:
        raise ConfigError(f"--config {path}: cannot read it ({exc.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--config {path}: not valid JSON ({exc})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("dp"), dict):
        raise ConfigError(
            f"--config {path}: must be a JSON object with 'job' and a 'dp' object, as the "
            "'config' that `cocoon-ckpt inspect URL --version V --json` prints"
        )
    return doc


def _tiers(args: argparse.Namespace) -> TierConfig | None:
    if args.tiers is None:
        return None
    try:
        rec = json.loads(args.tiers)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--tiers is not valid JSON ({exc}); pass a JSON object") from None
    if not isinstance(rec, dict):
        raise ConfigError("--tiers must be a JSON object, e.g. '{\"host_bytes\": 1073741824}'")
    try:
        return section_from_record(TierConfig, rec, "--tiers")
    except (TypeError, ValueError) as exc:
        msg = str(exc)
        raise ConfigError(msg if msg.startswith("--tiers") else f"--tiers: {msg}") from None


def _train_config(args: argparse.Namespace) -> tuple[JobConfig, str]:
    if args.store is not None and not args.store.strip():
        raise ConfigError(
            "Expected --store='' to name a store: a local path, memory://NAME or s3://BUCKET/PATH"
        )
    given = [k for k in _TRAIN_FLAGS if getattr(args, k) is not None]
    if args.config is not None:
        given += [k for k in _EMBEDDING_FLAGS if getattr(args, k) is not None]
        if given or args.example or args.job:
            flags = ", ".join("--" + k.replace("_", "-") for k in given) or "--example/--job"
            raise ConfigError(f"--config sets the whole job; drop {flags} or drop --config")
        rec = _read_config_file(args.config)
        if args.checkpoint_every is not None:
            rec["checkpoint_every"] = args.checkpoint_every
        if args.sync_checkpoints:
            rec["async_checkpoint"] = False
        if args.overlap_noise:
            rec["overlap_noise"] = True
        if args.lease_expiry is not None:
            rec["lease_expiry_s"] = args.lease_expiry
        tiers = _tiers(args)
        if tiers is not None:
            rec["tiers"] = tiers.to_record()
        try:
            config = JobConfig.from_record(rec)
        except (TypeError, KeyError, ValueError) as exc:
            raise ConfigError(f"--config {args.config}: {exc}") from None
        name = config.job.partition(":")[2] if config.job.startswith("example:") else "job"
        return config, args.store or f"runs/{name}.zarr"
    v = {
        k: (d if getattr(args, k) is None else getattr(args, k))
        for k, (d, _) in _TRAIN_FLAGS.items()
    }
    example = args.example or ("mlp" if args.job is None else None)
    job = f"example:{example}" if example else args.job
    config = JobConfig(
        job=job,
        dp=DPConfig(
            steps=v["steps"],
            batch_size=v["batch_size"],
            dataset_size=v["dataset_size"],
            noise_multiplier=v["noise_multiplier"],
            max_grad_norm=v["clip"],
            bands=v["bands"],
            delta=v["delta"],
            mechanism=MechanismKind(v["mechanism"]),
            seed=v["seed"],
        ),
        lr=v["lr"],
        optimizer=v["optimizer"],
        checkpoint_every=10 if args.checkpoint_every is None else args.checkpoint_every,
        async_checkpoint=not args.sync_checkpoints,
        log_level=args.log_level,
        tiers=_tiers(args),
        embedding=_embedding(args),
        overlap_noise=args.overlap_noise,
        **({} if args.lease_expiry is None else {"lease_expiry_s": args.lease_expiry}),
    )
    return config, args.store or f"runs/{example or 'job'}.zarr"


_EMBEDDING_FLAGS = ("embedding", "threat_model", "hot_threshold")


def _embedding(args: argparse.Namespace) -> Any:
    if all(getattr(args, k) is None for k in _EMBEDDING_FLAGS):
        return None
    from cocoon_ckpt.embedding.config import EmbeddingConfig, TableMode

    return EmbeddingConfig(
        mode=TableMode(args.embedding or "auto"),
        threat_model=args.threat_model or "intermediate_iterates",
        hot_threshold=args.hot_threshold,
    )


def _train(args: argparse.Namespace) -> int:
    config, store = _train_config(args)
    bar: Any = None
    on_step = None
    on_precompute = None
    # under torchrun every rank runs this; rank 0 alone shows progress and the result
    follower = os.environ.get("RANK", "0") != "0"
    if not args.no_progress and not follower:
        from tqdm import tqdm

        pre: list[Any] = []

        def on_precompute(done: int, total: int) -> None:
            if not pre:
                pre.append(tqdm(total=total, desc="precompute", unit="row", file=sys.stderr))
            pre[0].update(done - pre[0].n)
            if done >= total:
                pre[0].close()

        shown = {"eps": "-", "ckpt": "-"}

        def on_step(res: Any, trainer: Any) -> None:
            nonlocal bar
            if bar is None:  # made at the first step: a refused start draws no bar
                bar = tqdm(total=config.dp.steps, desc="train", unit="step", file=sys.stderr)
                bar.update(res.step)  # resumed: start the bar where the job is
            if trainer.step_index % config.checkpoint_every == 0:
                shown["ckpt"] = str(trainer.step_index)
            # never composes here: the checkpoint writer does, off the training thread
            eps = trainer.accountant.known_epsilon()
            if eps is not None:
                shown["eps"] = f"{eps:.3f}"
            bar.set_postfix(
                loss=f"{res.loss:.4f}", eps=shown["eps"], last_ckpt=shown["ckpt"], refresh=False
            )
            bar.update(1)

    from cocoon_ckpt.train.runner import run_job

    try:
        result = run_job(
            config,
            store,
            storage_options=_storage_options(args),
            key_file=args.key_file,
            takeover=args.takeover,
            allow_fallback=args.allow_fallback,
            on_step=on_step,
            on_precompute=on_precompute,
        )
    finally:
        if bar is not None:
            bar.close()
    out = {
        "store": store,
        "steps": result.steps_done,
        "resumed_from": result.resumed_from,
        "epsilon": result.epsilon,
        "delta": config.dp.delta,
        "version": result.version,
    }
    if follower:
        pass
    elif args.json:
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


def _export(args: argparse.Namespace) -> int:
    from cocoon_ckpt.tools.export import ExportPathError, export_model

    try:
        report = export_model(args.url, args.out, storage_options=_storage_options(args))
    except ExportPathError as exc:  # a wrong --out is a usage error: exit 2, not 1
        print(f"cocoon-ckpt: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report))
    else:
        print(
            f"exported {args.out} (epsilon={report['epsilon']:.4f}, delta={report['delta']:g}, "
            f"threat model {report['threat_model']}); report in {args.out}.privacy.json"
        )
    return 0


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def _inspect(args: argparse.Namespace) -> int:
    from cocoon_ckpt.tools.catalog import inspect_store

    out = inspect_store(args.url, version=args.version, storage_options=_storage_options(args))
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"{out['store']}: format {out['format_version']}, created {out['created']}")
    job = out.get("job")
    if job:
        print(
            f"job {job['job']} ({job['fingerprint']}): {job['steps_total']} steps, "
            f"b={job['bands']} {job['mechanism']}, sigma={job['noise_multiplier']}, "
            f"m={job['dim']}, key in {job['key_location']}"
        )
        print(f"threat model {job['threat_model']}: {job['threat_model_means']}")
    print(f"{'version':>7} {'step':>6} {'written':>10} {'total':>10} {'epsilon':>9}  kinds written")
    for v in out["versions"]:
        kinds = ", ".join(f"{k} {_size(n)}" for k, n in v["bytes_written_by_kind"].items())
        eps = "-" if v["epsilon"] is None else f"{v['epsilon']:.4f}"
        done = " (complete)" if v["complete"] else ""
        print(
            f"{v['version']:>7} {v['step']:>6} {_size(v['bytes_written']):>10} "
            f"{_size(v['bytes_total']):>10} {eps:>9}  {kinds}{done}"
        )
        for s in v["placement"]:
            print(f"{'':>16}noise [{s['start']}, {s['stop']}) on {s['tier']}, {s['slots']} slots")
        emb = v.get("embedding")
        if emb:
            paths = ", ".join(f"{n} {m}" for m, n in emb["modes"].items())
            csc = (
                f"; CSC {emb['csc_entries']:,} entries, {_size(emb['csc_bytes'])} (shared, "
                f"precomputed in {emb['precompute_seconds']:.1f} s)"
                if emb["csc_entries"]
                else ""
            )
            print(
                f"{'':>16}embedding: {emb['tables']} tables ({paths}), "
                f"{emb['hot_rows']:,} hot rows{csc}; cursor at step {emb['cursor']}"
            )
    for d in out["damaged_manifests"]:
        print(f"DAMAGED version {d['version']}: {d['error']}")
    holder = out["lease_holder"]
    if holder is None:
        writer = "none ever"
    else:
        state = "released" if holder.get("released") else "held"
        writer = f"{holder['owner']} (generation {holder['generation']}, {state})"
    print(f"writer lease: {writer}; noise key in store: {out['key_in_store']}")
    return 0


def _audit(args: argparse.Namespace) -> int:
    from cocoon_ckpt.tools.audit import audit_store

    report = audit_store(
        args.url,
        coordinates=args.coordinates,
        key_file=args.key_file,
        seed=args.seed,
        storage_options=_storage_options(args),
        plot_dir=args.plot,
        job=f"example:{args.example}" if args.example else args.job,
    )
    print(json.dumps(report.as_json()) if args.json else report.text())
    return 0 if report.ok else 1


def _diff(args: argparse.Namespace) -> int:
    from cocoon_ckpt.tools.catalog import diff_versions

    d = diff_versions(args.url, args.v1, args.v2, storage_options=_storage_options(args))
    if args.json:
        print(json.dumps(d))
        return 0
    print(
        f"version {args.v1} (step {d['from']['step']}) -> {args.v2} (step {d['to']['step']})"
        + ("" if d["same_job"] else "  DIFFERENT JOBS")
    )
    for key in ("added", "removed", "changed", "shared"):
        names = d[f"arrays_{key}"]
        print(
            f"  arrays {key:<8} {len(names):>4}  {' '.join(names[:6])}{' ...' * (len(names) > 6)}"
        )
    print(f"  bytes added     {_size(d['bytes_added'])}")
    for k, ch in d["records_changed"].items():
        if k != "noise.shards":
            print(f"  {k}: {ch['from']!r} -> {ch['to']!r}")
    return 0


def _gc(args: argparse.Namespace) -> int:
    from cocoon_ckpt.tools.catalog import collect_garbage

    out = collect_garbage(
        args.url,
        keep=args.keep,
        storage_options=_storage_options(args),
        takeover=args.takeover,
        discard_damaged=args.discard_damaged,
    )
    if args.json:
        print(json.dumps(out))
    else:
        print(
            f"kept versions {out['versions_kept']}; deleted {len(out['deleted'])} paths, "
            f"freed {_size(out['bytes_freed'])}"
        )
    return 0


#: Errors that mean the input was wrong (exit 2), not that a valid request was refused.
_USAGE_ERRORS = (
    ConfigError,
    NoiseKeyError,
    StoreNotFoundError,  # and NotAStoreError: a file, a user folder, a plain zarr group
    FormatVersionError,
    VersionNotFoundError,
)
#: OS errors about a path the user named (exit 2): missing, not a folder, too long.
_PATH_ERRNOS = frozenset(
    {errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.ENAMETOOLONG, errno.ELOOP, errno.EACCES}
)
#: botocore errors (by name: s3fs is optional) that mean missing or wrong credentials.
_CREDENTIAL_ERRORS = frozenset({"NoCredentialsError", "PartialCredentialsError"})


def _botocore_error(exc: BaseException) -> str | None:
    """The botocore class name of `exc` (or of the error it wraps), else None."""
    for e in (exc, exc.__cause__, exc.__context__):
        if e is not None and type(e).__module__.startswith("botocore"):
            return type(e).__name__
    return None


def _exit_code(exc: BaseException) -> int:
    """0 ok; 1 a valid request the job or store refused (or an environment failure);
    2 a usage error; 128 + N stopped by signal N (130 Ctrl-C, 143 SIGTERM)."""
    if isinstance(exc, PreemptedError):
        return 128 + exc.signum
    if isinstance(exc, KeyboardInterrupt):
        return 130
    if isinstance(exc, _USAGE_ERRORS):
        return 2
    if isinstance(exc, (CocoonError, StoreError)):
        return 1
    if isinstance(exc, ValueError):
        return 2
    if isinstance(exc, OSError) and exc.errno in _PATH_ERRNOS:
        return 2
    if _botocore_error(exc) in _CREDENTIAL_ERRORS:
        return 2
    return 1


def _message(exc: BaseException) -> str:
    """One line saying what went wrong and, where we know it, what to do."""
    name = _botocore_error(exc)
    if name in _CREDENTIAL_ERRORS:
        return (
            f"no usable S3 credentials ({exc}); set AWS_ACCESS_KEY_ID and "
            'AWS_SECRET_ACCESS_KEY (or a profile), or pass "key"/"secret" in '
            "--storage-options"
        )
    if name in ("EndpointConnectionError", "ConnectTimeoutError", "ConnectionClosedError"):
        return f"cannot reach the storage endpoint ({exc}); check endpoint_url in --storage-options"
    if isinstance(exc, OSError) and exc.strerror and exc.filename is not None:
        path = str(exc.filename)
        path = path if len(path) <= 120 else path[:60] + "..." + path[-40:]
        return f"{path}: {exc.strerror}"
    text = str(exc) or type(exc).__name__
    if not isinstance(exc, (CocoonError, StoreError, ValueError, OSError)):
        # not one of ours: name the class, and where the details are
        text = f"{type(exc).__name__}: {text} (--log-level DEBUG prints the traceback)"
    return " ".join(text.split())  # one line, whatever the message holds


_COMMANDS = {
    "train": _train,
    "export": _export,
    "inspect": _inspect,
    "audit": _audit,
    "diff": _diff,
    "gc": _gc,
    "chaos": _chaos,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point. Exit codes: 0 ok; 1 the job or store refused, or audit findings;
    2 usage errors (bad arguments, not a store, a newer format, a missing version or
    key); 130 / 143 stopped by SIGINT / SIGTERM (after a checkpoint, when training)."""
    try:
        code = _main(argv)
        sys.stdout.flush()  # a closed pipe shows here, not at exit
        return code
    except BrokenPipeError:
        # `cocoon-ckpt inspect URL | head`: the reader left; say nothing more
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 141  # 128 + SIGPIPE, as the shell reports a process the pipe ended
    except KeyboardInterrupt as exc:
        print("cocoon-ckpt: interrupted", file=sys.stderr)
        return _exit_code(exc)


def _main(argv: Sequence[str] | None) -> int:
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error already printed
        return exc.code if isinstance(exc.code, int) else 2
    # Crash points for kill tests (COCOON_CRASH_AT); nothing is armed without it.
    if os.environ.get("COCOON_CRASH_AT"):
        from fault_injection.crash import arm_from_env

        arm_from_env()
    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s")
    try:
        return _COMMANDS[args.command](args)
    except (BrokenPipeError, KeyboardInterrupt):
        raise
    except PreemptedError as exc:
        print(f"cocoon-ckpt: {_message(exc)}", file=sys.stderr)
        return _exit_code(exc)
    except Exception as exc:
        if args.log_level == "DEBUG":
            traceback.print_exc()
        print(f"cocoon-ckpt: error: {_message(exc)}", file=sys.stderr)
        return _exit_code(exc)


if __name__ == "__main__":
    sys.exit(main())
