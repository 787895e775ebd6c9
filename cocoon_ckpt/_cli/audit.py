"""`cocoon-ckpt audit`: check everything a store claims and change nothing."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

from cocoon_ckpt._cli.args import add_json, add_storage_options, seed, storage_options

if TYPE_CHECKING:
    from cocoon_ckpt._cli.args import Subparsers
    from cocoon_ckpt.tools.audit import AuditReport

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
    p.add_argument(
        "--delta",
        type=_delta,
        action="append",
        default=None,
        metavar="DELTA",
        help="also report epsilon at DELTA (repeatable), composed from the newest version's "
        "stored accounting event once it agrees with the event its config and step imply",
    )
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
    from cocoon_ckpt.train.parts import resolve

    report = audit_store(
        args.url,
        coordinates=args.coordinates,
        key_file=args.key_file,
        seed=args.seed,
        storage_options=storage_options(args),
        plot_dir=args.plot,
        # the job the user names on this command line (found in the current folder, as
        # `train --job` finds it), never one the store names
        job=f"example:{args.example}"
        if args.example
        else (resolve(args.job, search_cwd=True) if args.job else None),
    )
    if args.delta:
        _epsilon_at(report, args.url, storage_options(args), args.delta)
    print(json.dumps(report.as_json()) if args.json else report.text())
    return 0 if report.ok else 1


def _delta(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"--delta {text}: must be a number in (0, 1)")
    return value


def _epsilon_at(
    report: AuditReport, url: str, options: dict[str, Any] | None, deltas: list[float]
) -> None:
    """Add epsilon at each of `deltas` to `report.info`, composed from the stored event of
    the newest version that verifies; a stored event other than the one its config and
    step imply is a finding instead (nothing is computed from it)."""
    from cocoon_ckpt.dp.accounting.accountant import Accountant
    from cocoon_ckpt.dp.accounting.amplified import epsilon_of_event
    from cocoon_ckpt.train.config import DPConfig
    from state import Store

    store = Store.open(url, storage_options=options, create=False)
    # the records are covered by the manifest checksum; the audit has read the arrays
    latest = store.latest(verify=False, allow_fallback=True)
    if latest is None:
        return
    try:
        acc = latest.records["accountant"]
        dp = DPConfig.from_record(latest.records["config"]["dp"])
        implied = Accountant(
            noise_multiplier=dp.sigma,
            dataset_size=dp.dataset_size,
            batch_size=dp.batch_size,
            bands=dp.bands,
            delta=dp.delta,
        )
        implied.step(latest.step)
        event, method = acc["event"], str(acc.get("method", "pld"))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        report.add(
            "accountant", f"epsilon at --delta: records cannot be read ({exc})", latest.version
        )
        return
    if event != implied.event():
        report.add(
            "accountant",
            f"stored accounting event {event!r} is not the one the config and step "
            f"{latest.step} imply ({implied.event()!r}); no epsilon at --delta from it",
            latest.version,
        )
        return
    at = {f"delta={d:g}": epsilon_of_event(event, d, method) if event else 0.0 for d in deltas}
    report.info["epsilon_at_delta"] = {
        **at,
        "version": latest.version,
        "steps": latest.step,
        "accounting_method": method,
        "from": "the version's stored dp-accounting event",
    }
