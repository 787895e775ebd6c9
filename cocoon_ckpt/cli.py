"""`cocoon-ckpt`: the command line above all three packages (a thin layer over the API)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from typing import Any

from state import StoreError

from .config import DPConfig, JobConfig
from .errors import CocoonError
from .job import export_model, run_job
from .mechanism import MechanismKind

__all__ = ["main"]


def _add_storage_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--storage-options",
        default=None,
        metavar="JSON",
        help="fsspec options for the store URL as a JSON object, e.g. "
        '\'{"endpoint_url": "http://127.0.0.1:5000"}\' for an S3-compatible endpoint',
    )


def _storage_options(args: argparse.Namespace) -> dict[str, Any] | None:
    if args.storage_options is None:
        return None
    try:
        opts = json.loads(args.storage_options)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"--storage-options is not valid JSON ({exc}); pass a JSON object"
        ) from None
    if not isinstance(opts, dict):
        raise ValueError("--storage-options must be a JSON object, e.g. '{\"anon\": false}'")
    return opts


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
    p.add_argument(
        "--store",
        default=None,
        help="store URL: local path, memory://, s3://... (default: runs/<example>.zarr)",
    )
    p.add_argument("--steps", type=int, default=50, help="total training steps n (default 50)")
    p.add_argument(
        "--checkpoint-every", type=int, default=10, help="steps between checkpoints K (default 10)"
    )
    p.add_argument("--seed", type=int, default=0, help="sampler and init seed (default 0)")
    p.add_argument("--bands", type=int, default=8, help="BandMF bands b; 1 = DP-SGD (default 8)")
    p.add_argument("--batch-size", type=int, default=32, help="expected batch size B (default 32)")
    p.add_argument(
        "--dataset-size",
        type=int,
        default=2048,
        help="examples N in the synthetic dataset (default 2048)",
    )
    p.add_argument(
        "--noise-multiplier",
        type=float,
        default=1.0,
        help="sigma; fresh noise std = sigma * clip (default 1.0)",
    )
    p.add_argument("--clip", type=float, default=1.0, help="per-sample L2 clip norm (default 1.0)")
    p.add_argument(
        "--delta", type=float, default=1e-5, help="delta of reported epsilon (default 1e-5)"
    )
    p.add_argument(
        "--mechanism",
        choices=[m.value for m in MechanismKind if m is not MechanismKind.CUSTOM],
        default="banded_sqrt",
        help="band coefficients (default banded_sqrt)",
    )
    p.add_argument("--lr", type=float, default=0.1, help="learning rate (default 0.1)")
    p.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd", help="(default sgd)")
    p.add_argument(
        "--key-file",
        default=None,
        help="keep the secret noise key in this file (0600) instead of the store",
    )
    _add_storage_options(p)
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
        "--sync-checkpoints",
        action="store_true",
        help="write checkpoints in the foreground (default: background thread)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def _add_export(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "export",
        help="write the final model (no noise state) and a privacy report",
        description="Write the completed job's model state_dict to OUT (torch.save) and "
        "its privacy report to OUT.privacy.json. No noise key or history is exported.",
    )
    p.add_argument("url", help="store URL")
    p.add_argument("--out", required=True, help="output file for the state_dict")
    _add_storage_options(p)
    p.add_argument("--json", action="store_true", help="print the privacy report as JSON")


def _add_chaos(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "chaos",
        help="random crash schedules on faulty storage, each compared with a golden run",
        description="Draw N random fault schedules (crash points at random steps, transient "
        "storage errors, lost responses, slow writes, bit flips at rest), run each to "
        "completion with resumes on a faulty memory:// store, and compare every step with an "
        "uninterrupted run; then run --kill-trials real subprocesses SIGKILLed at a crash "
        "point and at random moments and compare their final models. Exit 1 if anything "
        "diverged, was lost or went undetected.",
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
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def _chaos(args: argparse.Namespace) -> int:
    from fault_injection import run_chaos, run_kill_chaos

    if args.trials < 1:
        raise ValueError(f"--trials={args.trials} must be >= 1")
    if args.kill_trials < 0:
        raise ValueError(f"--kill-trials={args.kill_trials} must be >= 0")
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
    if args.kill_trials:
        train_args = [
            *("--example", args.example, "--steps", str(args.steps), "--bands", str(args.bands)),
            *("--checkpoint-every", str(args.checkpoint_every), "--batch-size", "16"),
            *("--dataset-size", "512"),
        ]
        run_kill_chaos(train_args, trials=args.kill_trials, seed=args.seed, report=report)
    if args.json:
        print(json.dumps(report.as_json()))
    else:
        print(report.table())
        for line in report.failures:
            print(f"FAILED {line}")
    return 0 if report.ok else 1


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="cocoon-ckpt",
        description="Differentially private training with correlated noise that can crash "
        "anywhere and resume exactly.",
    )
    p.add_argument("--log-level", default="WARNING", help="logging level (default WARNING)")
    sub = p.add_subparsers(dest="command", required=True)
    _add_train(sub)
    _add_export(sub)
    _add_chaos(sub)
    return p


def _train(args: argparse.Namespace) -> int:
    example = args.example or ("mlp" if args.job is None else None)
    job = f"example:{example}" if example else args.job
    store = args.store or f"runs/{example or 'job'}.zarr"
    config = JobConfig(
        job=job,
        dp=DPConfig(
            steps=args.steps,
            batch_size=args.batch_size,
            dataset_size=args.dataset_size,
            noise_multiplier=args.noise_multiplier,
            max_grad_norm=args.clip,
            bands=args.bands,
            delta=args.delta,
            mechanism=MechanismKind(args.mechanism),
            seed=args.seed,
        ),
        lr=args.lr,
        optimizer=args.optimizer,
        checkpoint_every=args.checkpoint_every,
        async_checkpoint=not args.sync_checkpoints,
        log_level=args.log_level,
    )
    bar: Any = None
    on_step = None
    if not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=config.dp.steps, desc="train", unit="step", file=sys.stderr)

        def on_step(res: Any, trainer: Any) -> None:
            if bar.n == 0 and res.step > 0:
                bar.update(res.step)
            bar.set_postfix(loss=f"{res.loss:.4f}", batch=res.batch_size, refresh=False)
            bar.update(1)
            if trainer.step_index % config.checkpoint_every == 0:
                bar.set_postfix(
                    loss=f"{res.loss:.4f}", eps=f"{trainer.epsilon():.3f}", ckpt=trainer.step_index
                )

    try:
        result = run_job(
            config,
            store,
            storage_options=_storage_options(args),
            key_file=args.key_file,
            takeover=args.takeover,
            allow_fallback=args.allow_fallback,
            on_step=on_step,
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
    if args.json:
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
    report = export_model(args.url, args.out, storage_options=_storage_options(args))
    if args.json:
        print(json.dumps(report))
    else:
        print(
            f"exported {args.out} (epsilon={report['epsilon']:.4f}, delta={report['delta']:g}, "
            f"threat model {report['threat_model']}); report in {args.out}.privacy.json"
        )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point. Exit codes: 0 ok, 1 the job or store refused, 2 usage errors."""
    parser = _parser()
    args = parser.parse_args(argv)
    # Crash points for kill tests (COCOON_CRASH_AT); nothing is armed without it.
    from fault_injection import arm_from_env

    arm_from_env()
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "train":
            return _train(args)
        if args.command == "chaos":
            return _chaos(args)
        return _export(args)
    except (CocoonError, StoreError) as exc:  # the job or the store refused
        print(f"cocoon-ckpt: error: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:  # a bad argument value
        print(f"cocoon-ckpt: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"cocoon-ckpt: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
