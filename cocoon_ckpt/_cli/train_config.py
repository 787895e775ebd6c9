"""The job a `train` command line describes: its flags (or --config FILE) as a JobConfig.

Every default the command does not choose itself is read from the config dataclasses'
fields, so the CLI cannot drift from the API. It chooses only the example job's sizes,
which DPConfig leaves to the caller, sigma = 1 unless a target epsilon is given, and b = 8
bands (DPConfig's default, 1, is DP-SGD).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from typing import TYPE_CHECKING, Any

from cocoon_ckpt.dp._validate import MAX_COUNT
from cocoon_ckpt.errors import ConfigError
from cocoon_ckpt.tiers.config import TierConfig
from cocoon_ckpt.train.config import ACCOUNTANTS, DPConfig, JobConfig, section_from_record

if TYPE_CHECKING:
    from cocoon_ckpt.train.parts import Builder, JobParts
from state.canonical_json import load_bounded

__all__ = [
    "EMBEDDING_FLAGS",
    "EXAMPLE_DEFAULTS",
    "JOB_FLAGS",
    "TARGET_FLAGS",
    "add_target_flags",
    "field_default",
    "flag_default",
    "flag_words",
    "train_config",
]

#: The job and privacy flags of `train` (argparse dest) and the JobConfig field each sets.
JOB_FLAGS: dict[str, str] = {
    "steps": "dp.steps",
    "batch_size": "dp.batch_size",
    "dataset_size": "dp.dataset_size",
    "noise_multiplier": "dp.noise_multiplier",
    "clip": "dp.max_grad_norm",
    "bands": "dp.bands",
    "delta": "dp.delta",
    "mechanism": "dp.mechanism",
    "seed": "dp.seed",
    "physical_batch_size": "dp.physical_batch_size",
    "noise_rng": "dp.noise_rng",
    "clipping": "dp.clipping",
    "lr": "lr",
    "optimizer": "optimizer",
}

#: The target-epsilon flags (argparse dest) and the JobConfig field each sets; `train` adds
#: them with `add_target_flags`.
TARGET_FLAGS: dict[str, str] = {
    "target_epsilon": "dp.target_epsilon",
    "accountant": "dp.accountant",
}

#: The flags of the embedding section (argparse dest) and the EmbeddingConfig field each sets.
EMBEDDING_FLAGS: dict[str, str] = {
    "embedding": "mode",
    "threat_model": "threat_model",
    "hot_threshold": "hot_threshold",
    "csc_window_steps": "csc_window_steps",
}

#: What the CLI chooses itself: the built-in example job's sizes (DPConfig has no default
#: for them), sigma = 1 when no --target-epsilon is given, and BandMF with 8 bands, not
#: DPConfig's DP-SGD (bands=1).
#: The built-in examples (`--example NAME`, `--job example:NAME`).
EXAMPLE_NAMES = ("mlp", "dlrm")

EXAMPLE_DEFAULTS: dict[str, Any] = {
    "steps": 50,
    "batch_size": 32,
    "dataset_size": 2048,
    "noise_multiplier": 1.0,
    "bands": 8,
}


#: The flags of `train` that set JobConfig fields outside JOB_FLAGS and TARGET_FLAGS.
_OTHER_FLAGS: dict[str, str] = {
    "JobConfig.job": "--job",
    "JobConfig.checkpoint_every": "--checkpoint-every",
    "JobConfig.grad_threads": "--grad-threads",
    "JobConfig.lease_expiry_s": "--lease-expiry",
    "JobConfig.log_level": "--log-level",
}


def _field_flags() -> dict[str, str]:
    """Each config field the flags of `train` set, as messages name it
    (`DPConfig.bands`), and its flag (`--bands`)."""
    out = dict(_OTHER_FLAGS)
    for dest, path in (JOB_FLAGS | TARGET_FLAGS).items():
        section, _, name = path.rpartition(".")
        out[f"{'DPConfig' if section == 'dp' else 'JobConfig'}.{name}"] = "--" + dest.replace(
            "_", "-"
        )
    return out


_EXPECTED = re.compile(r"Expected ((?:DPConfig|JobConfig)\.\w+)=(.*?) to (.*)", re.DOTALL)
_FIELD_VALUE = re.compile(r"\b((?:DPConfig|JobConfig)\.\w+)(=('[^']*'|\S+?(?=[,;:)\s]|$)))?")
_BARE_VALUE = re.compile(r"(?<![\w.-])(\w+)=")


def _shown(value: str) -> str:
    """A value as typed on the command line: a quoted string without its quotes."""
    quoted = len(value) >= 2 and value[0] == value[-1] == "'"
    return value[1:-1] if quoted else value


def flag_words(text: str) -> str:
    """A message of the config classes in the words of `train`'s command line: each
    field the flags set named by its flag (`Expected DPConfig.bands=8 to be <=
    steps=4` -> `--bands 8 must be <= --steps 4`). The Python API keeps the field names;
    the CLI translates at its boundary (not for `--config FILE`, whose user wrote fields).
    """
    flags = _field_flags()
    short = {k.partition(".")[2]: v for k, v in flags.items()}
    m = _EXPECTED.fullmatch(text)
    if m is not None and m.group(1) in flags:
        rule = _BARE_VALUE.sub(
            lambda b: f"{short[b.group(1)]} " if b.group(1) in short else b.group(0), m.group(3)
        )
        text = f"{flags[m.group(1)]} {_shown(m.group(2))} must {rule}"

    def field(f: re.Match[str]) -> str:
        flag = flags.get(f.group(1))
        if flag is None:
            return f.group(0)
        return flag if f.group(3) is None else f"{flag} {_shown(f.group(3))}"

    text = _FIELD_VALUE.sub(field, text)
    # "--dataset-size 2048 ... set --dataset-size (--dataset-size)": the flag once
    return re.sub(r"(--[a-z-]+)( [^()]*)? \(\1\)", r"\1\2", text)


def field_default(cls: type, name: str) -> Any:
    """The default of dataclass `cls`'s field `name`.

    Raises:
        KeyError: `cls` has no such field, or it has no plain default.
    """
    for f in dataclasses.fields(cls):
        if f.name == name and f.default is not dataclasses.MISSING:
            return f.default
    raise KeyError(f"{cls.__name__}.{name} has no default; give the CLI one in EXAMPLE_DEFAULTS")


def flag_default(flag: str) -> Any:
    """What a job flag (argparse dest, a key of JOB_FLAGS) is when not given, as the
    command line spells it (an enum by its value)."""
    if flag in EXAMPLE_DEFAULTS:
        return EXAMPLE_DEFAULTS[flag]
    section, _, name = (JOB_FLAGS | TARGET_FLAGS)[flag].rpartition(".")
    value = field_default(DPConfig if section == "dp" else JobConfig, name)
    return getattr(value, "value", value)


def add_target_flags(p: argparse.ArgumentParser) -> None:
    """Add `--target-epsilon` and `--accountant` to the `train` parser."""
    p.add_argument(
        "--target-epsilon",
        type=float,
        metavar="EPSILON",
        help="calibrate sigma once at job start so that epsilon at --delta after --steps "
        "steps stays within EPSILON, and record it (a resume reuses it); instead of "
        f"--noise-multiplier {_shown_default('target_epsilon')}",
    )
    p.add_argument(
        "--accountant",
        choices=ACCOUNTANTS,
        help="how epsilon is composed, for the calibration and the reported epsilon: "
        f"pld (tight) or rdp (looser) {_shown_default('accountant')}",
    )


def _shown_default(flag: str) -> str:
    return f"(default {flag_default(flag)})"


def _given(args: argparse.Namespace, flags: dict[str, str]) -> dict[str, Any]:
    """The flags of `flags` given on the command line (a parser built without
    `add_target_flags` has no target flags: none given)."""
    return {k: getattr(args, k, None) for k in flags if getattr(args, k, None) is not None}


def _read_config_file(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            doc = load_bounded(f.read())  # a RecursionError would name nothing
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
        rec = load_bounded(args.tiers)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--tiers is not valid JSON ({exc}); pass a JSON object") from None
    if not isinstance(rec, dict):
        raise ConfigError("--tiers must be a JSON object, e.g. '{\"host_bytes\": 1073741824}'")
    try:
        return section_from_record(TierConfig, rec, "--tiers")
    except (TypeError, ValueError) as exc:
        msg = str(exc)
        raise ConfigError(msg if msg.startswith("--tiers") else f"--tiers: {msg}") from None


def _embedding(args: argparse.Namespace) -> Any:
    """The EmbeddingConfig the embedding flags give (its own defaults for the others), or
    None when none is given."""
    given = {
        f: getattr(args, k) for k, f in EMBEDDING_FLAGS.items() if getattr(args, k) is not None
    }
    if not given:
        return None
    if set(given) == {"csc_window_steps"}:
        raise ConfigError(
            f"--csc-window-steps {given['csc_window_steps']}: the job's embedding tables are "
            "part of the dense noise vector and have no CSC; give it with --embedding "
            "coalesced (or auto) and --threat-model final_model, or drop it"
        )
    from cocoon_ckpt.embedding.config import EmbeddingConfig

    return EmbeddingConfig(**given)


def _harmless(args: argparse.Namespace) -> dict[str, Any]:
    """The JobConfig fields a resume may change that the flags set (absent: not given)."""
    out: dict[str, Any] = {}
    if args.checkpoint_every is not None:
        out["checkpoint_every"] = args.checkpoint_every
    if args.sync_checkpoints:
        out["async_checkpoint"] = False
    if args.overlap_noise:
        out["overlap_noise"] = True
    if args.grad_threads is not None:
        out["grad_threads"] = args.grad_threads
    if args.lease_expiry is not None:
        out["lease_expiry_s"] = args.lease_expiry
    return out


def train_config(args: argparse.Namespace) -> tuple[JobConfig, str]:
    """The job and the store URL a parsed `train` command line names (`train_job`
    without options, and without building a user's job).
    """
    config, store, _ = train_job(args, {}, build=False)
    return config, store


def train_job(
    args: argparse.Namespace, options: dict[str, Any], *, build: bool = True
) -> tuple[JobConfig, str, Builder | None]:
    """The job, the store URL and the builder a parsed `train` command line names, with
    `options` (--job-option) in the config.

    A job of the user's (`--job`) is built here, once: its optimizer's class and
    learning rate and its dataset's length are the job's `optimizer`, `lr` and
    `dp.dataset_size` unless --optimizer, --lr or --dataset-size is given (an override,
    then checked against the objects as for any job). The builder returned hands those
    built parts on, so the job is not built twice. A target epsilon is left to the
    start, which calibrates it once against the store it opens (`train.start`).

    Raises:
        ConfigError: --store is blank, --config is combined with job flags, both
            --noise-multiplier and --target-epsilon are given, or the config file,
            --tiers or a flag's value is refused.
    """
    if args.store is not None and not args.store.strip():
        raise ConfigError(
            "Expected --store='' to name a store: a local path, memory://NAME or s3://BUCKET/PATH"
        )
    if args.job is not None and args.job.startswith("example:"):
        # `example:NAME` is how a store and a --config file name a built-in example: the
        # job --example NAME runs, with its defaults (not a user's job built to read them)
        name = args.job.partition(":")[2]
        if name not in EXAMPLE_NAMES:
            raise ConfigError(
                f"--job {args.job}: no built-in example {name!r}; use one of "
                + ", ".join(f"example:{n}" for n in EXAMPLE_NAMES)
            )
        args = argparse.Namespace(**{**vars(args), "example": name, "job": None})
    if args.config is not None:
        given = list(_given(args, JOB_FLAGS | TARGET_FLAGS | EMBEDDING_FLAGS))
        if given or args.example or args.job:
            flags = ", ".join("--" + k.replace("_", "-") for k in given) or "--example/--job"
            raise ConfigError(f"--config sets the whole job; drop {flags} or drop --config")
        rec = _read_config_file(args.config) | _harmless(args)
        tiers = _tiers(args)
        if tiers is not None:
            rec["tiers"] = tiers.to_record()
        try:
            config = JobConfig.from_record(rec)
        except (TypeError, KeyError, ValueError) as exc:
            raise ConfigError(f"--config {args.config}: {exc}") from None
        if options:
            config = dataclasses.replace(config, options=options)
        name = config.job.partition(":")[2] if config.job.startswith("example:") else "job"
        store = args.store or f"runs/{name}.zarr"
        return config, store, _user_builder(config)
    # flags not given are left out, so the dataclasses' own defaults apply
    chosen = _given(args, JOB_FLAGS | TARGET_FLAGS)
    if "target_epsilon" in chosen and "noise_multiplier" in chosen:
        raise ConfigError(
            "--noise-multiplier and --target-epsilon both given: give sigma, or the epsilon "
            "to calibrate it for, not both"
        )
    example_defaults = {
        k: v
        for k, v in EXAMPLE_DEFAULTS.items()
        if not (k == "noise_multiplier" and "target_epsilon" in chosen)
        # a user's job sizes its own dataset: it is read from the job when built
        and not (k == "dataset_size" and args.job is not None and build)
    }
    values = example_defaults | chosen
    fields = JOB_FLAGS | TARGET_FLAGS
    dp = {
        fields[k].removeprefix("dp."): v for k, v in values.items() if fields[k].startswith("dp.")
    }
    job = {fields[k]: v for k, v in values.items() if not fields[k].startswith("dp.")}
    example = args.example or ("mlp" if args.job is None else None)
    builder = None
    if example is None and build:
        # the flags' own checks first, in a second: importing and building the job takes
        # as long as the job's imports and data (N is the job's, so any N passes here)
        DPConfig(**{"dataset_size": MAX_COUNT, **dp})
        builder = _user_builder_of(args.job)
        dp, job, builder = _from_job(args.job, builder, dp, job, options, args)
    config = JobConfig(
        job=f"example:{example}" if example else args.job,
        dp=DPConfig(**dp),
        log_level=args.log_level,
        tiers=_tiers(args),
        embedding=_embedding(args),
        options=dict(options),
        **job,
        **_harmless(args),
    )
    store = args.store or f"runs/{example or 'job'}.zarr"
    return config, store, builder


def _user_builder_of(job: str) -> Builder:
    """The builder `--job` names, found beside the user first (`python -m` would): a
    missing module or function stops the command before anything is written."""
    from cocoon_ckpt.train.parts import resolve

    return resolve(job, search_cwd=True)


def _user_builder(config: JobConfig) -> Builder | None:
    """The builder of a --config file's job of the user's (None: a built-in example)."""
    return None if config.job.startswith("example:") else _user_builder_of(config.job)


def _from_job(
    name: str,
    builder: Builder,
    dp: dict[str, Any],
    job: dict[str, Any],
    options: dict[str, Any],
    args: argparse.Namespace,
) -> tuple[dict[str, Any], dict[str, Any], Builder]:
    """The job's own optimizer, lr and dataset size where no flag gives them: the job is
    built with the config the flags give (every other field as it will run), and what
    its objects say fills the rest. Returns the dp and job fields, and a builder that
    hands the built parts on with the random state the build left (the job, not its
    probe, decides every later draw)."""
    import random

    import numpy as np
    import torch

    from cocoon_ckpt.train.build import job_parts
    from cocoon_ckpt.train.identity import optimizer_description

    # the dataset's length is what this build reads; the probe's DPConfig needs one
    probe_dp = {"dataset_size": EXAMPLE_DEFAULTS["dataset_size"], **dp}
    probe = JobConfig(
        job=name,
        dp=DPConfig(**probe_dp),
        log_level=args.log_level,
        tiers=_tiers(args),
        embedding=_embedding(args),
        options=dict(options),
        **job,
        **_harmless(args),
    )
    parts = job_parts(probe, builder)
    states = (torch.get_rng_state(), np.random.get_state(), random.getstate())
    optimizer, lr = optimizer_description(parts.optimizer, parts.scheduler)
    job = {"optimizer": optimizer, "lr": lr, **job}
    if "dataset_size" not in dp:
        try:
            dp = {**dp, "dataset_size": len(parts.dataset)}  # type: ignore[arg-type]
        except TypeError:
            raise ConfigError(
                f"job {name!r}: its dataset has no len(), so the dataset size N the "
                "accounting needs cannot be read from it; pass --dataset-size N"
            ) from None

    def built(_config: JobConfig) -> JobParts:
        torch.set_rng_state(states[0])
        np.random.set_state(states[1])
        random.setstate(states[2])
        return parts

    return dp, job, built
