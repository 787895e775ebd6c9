"""`cocoon-ckpt audit`: check everything a store claims and change nothing."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

from cocoon_ckpt._cli.args import add_json, add_storage_options, seed, storage_options

if TYPE_CHECKING:
    from cocoon_ckpt._cli.args import Subparsers

__all__ = ["COORDINATES", "add_parser", "run"]

#: audit_store's default K, restated so that `audit --help` does not import the audit
#: (and torch); tests/_cli/test_defaults.py holds the two equal.
COORDINATES = 256


def add_parser(sub: Subparsers) -> None:
    """Add `audit` to the top-level subcommands."""
    p = sub.add_parser(
        "audit",
        help="verify every checksum, regenerate the noise from the key, recompute epsilon",
        description="Check a store and change nothing: the manifest chain; every array's "
        "checksum; the stored ring slots against noise regenerated from the key at K random "
        "coordinates over all steps; epsilon recomputed from the recorded configuration; the "
        "config fingerprint and key id of every version; who can read the store; the threat "
        "model. Exit 0 when all holds, 1 with a list of findings, 2 on usage errors.",
    )
    p.set_defaults(handler=run)
    p.add_argument("url", help="store URL")
    p.add_argument(
        "--coordinates",
        type=int,
        default=COORDINATES,
        metavar="K",
        help=f"noise coordinates to regenerate over all steps (default {COORDINATES}; all "
        "if >= the model size)",
    )
    p.add_argument(
        "--key-file", default=None, help="the noise key, for a job that kept it outside the store"
    )
    p.add_argument(
        "--seed",
        type=seed,
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
    add_storage_options(p)
    add_json(p, "report")


def run(args: argparse.Namespace) -> int:
    """Audit store `args.url` and print the report. Exit 0 when all holds, 1 with findings."""
    from cocoon_ckpt.tools.audit import audit_store

    report = audit_store(
        args.url,
        coordinates=args.coordinates,
        key_file=args.key_file,
        seed=args.seed,
        storage_options=storage_options(args),
        plot_dir=args.plot,
        job=f"example:{args.example}" if args.example else args.job,
    )
    print(json.dumps(report.as_json()) if args.json else report.text())
    return 0 if report.ok else 1
