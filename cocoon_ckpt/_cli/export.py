"""`cocoon-ckpt export`: the finished job's model and its privacy report."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from cocoon_ckpt._cli.args import add_json, add_storage_options, storage_options

if TYPE_CHECKING:
    from cocoon_ckpt._cli.args import Subparsers

__all__ = ["add_parser", "run"]


def add_parser(sub: Subparsers) -> None:
    """Add `export` to the top-level subcommands."""
    p = sub.add_parser(
        "export",
        help="write the final model (no noise state) and a privacy report",
        description="Write the finished job's model state_dict to OUT (torch.save) and "
        "its privacy report to OUT.privacy.json, both or neither. Its keys are the plain "
        "model's (none carries torch.compile's _orig_mod. prefix). Finished means the "
        "verified step count equals the config's; epsilon is recomputed from the config. "
        "No noise key or history is exported.",
    )
    p.set_defaults(handler=run)
    p.add_argument("url", help="store URL")
    p.add_argument(
        "--out",
        required=True,
        help="new output file for the state_dict, outside the store, in an existing folder",
    )
    p.add_argument(
        "--key-file",
        default=None,
        help="the job's key file (when the key is not kept in the store): the version is "
        "then authenticated by its MACs; a final_model job is exported only so",
    )
    p.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        help="export a version without MACs (written before store format 4) although the "
        "key is at hand",
    )
    add_storage_options(p)
    add_json(p, "privacy report")


def run(args: argparse.Namespace) -> int:
    """Export the model and report of store `args.url` to `args.out`. Exit 0; a wrong
    --out raises ExportPathError (exit 2, see exits)."""
    from cocoon_ckpt.tools.export import export_model

    report = export_model(
        args.url,
        args.out,
        storage_options=storage_options(args),
        key_file=args.key_file,
        allow_unauthenticated=args.allow_unauthenticated,
    )
    if args.json:
        print(json.dumps(report))
    else:
        print(
            f"exported {args.out} (epsilon={report['epsilon']:.4f}, delta={report['delta']:g}, "
            f"threat model {report['threat_model']}); report in {args.out}.privacy.json"
        )
        if not report["source"]["authenticated"]:
            print(
                "warning: not authenticated by the job's key (pass --key-file): only "
                "unkeyed checksums vouch for the exported version",
                file=sys.stderr,
            )
    return 0
