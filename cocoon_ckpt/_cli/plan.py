"""`cocoon-ckpt plan`: before a job, which bands b and mechanism to train with.

For each candidate (b, mechanism) at the target epsilon it prints the calibrated sigma,
the predicted error (sigma^2 times the prefix-sum workload loss, the number that
predicted the digits results), the noise-state bytes and the GEMV reads per step, and
recommends the row of smallest predicted error (`cocoon_ckpt.dp.plan`)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from cocoon_ckpt._cli.args import add_json

if TYPE_CHECKING:
    from cocoon_ckpt._cli.args import Subparsers

__all__ = ["add_parser", "run"]

#: The values of cocoon_ckpt.dp.mechanism.MechanismKind that plan compares (spelt out
#: so `plan --help` starts without torch).
_MECHANISMS = ("banded_sqrt", "optimized", "optimized_colnorm", "blt")
#: Those compared when none is named (blt is never better where sampling amplifies;
#: optimized_colnorm is optimized to within 0.0002-3%).
_DEFAULT_MECHANISMS = ("banded_sqrt", "optimized")


def _bands(text: str) -> list[int]:
    try:
        out = [int(b) for b in text.split(",") if b.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--bands {text!r} must be comma-separated integers, e.g. 1,2,4,8"
        ) from None
    if not out:
        raise argparse.ArgumentTypeError("--bands needs at least one integer, e.g. 1,2,4,8")
    return out


def add_parser(sub: Subparsers) -> None:
    """Add `plan` to the top-level subcommands."""
    p = sub.add_parser(
        "plan",
        help="choose bands and mechanism: sigma and predicted error at a target epsilon",
        description="Calibrate sigma for each candidate number of bands b and mechanism "
        "at the target epsilon, predict the noise error of the summed updates (b = 1 is "
        "DP-SGD), and recommend the smallest. Writes nothing.",
    )
    p.set_defaults(handler=run)
    p.add_argument("--target-epsilon", type=float, required=True, help="epsilon to reach")
    p.add_argument("--delta", type=float, required=True, help="delta, e.g. 1e-5")
    p.add_argument("--dataset-size", type=int, required=True, help="N, training examples")
    p.add_argument("--batch-size", type=int, required=True, help="B, expected batch size")
    p.add_argument("--steps", type=int, required=True, help="n, training steps")
    p.add_argument(
        "--bands", type=_bands, default=None, metavar="B1,B2,...",
        help="candidate b values (default: powers of two the data allows)",
    )  # fmt: skip
    p.add_argument(
        "--mechanism", action="append", choices=_MECHANISMS, default=None,
        help="compare only this mechanism (repeatable; default: banded_sqrt and optimized)",
    )  # fmt: skip
    p.add_argument("--params", type=int, default=None, help="model parameters, for byte totals")
    p.add_argument("--method", choices=("pld", "rdp"), default="pld", help="accounting")
    add_json(p, "plan")


def run(args: argparse.Namespace) -> int:
    """Print the plan. Exit 0; out-of-range arguments raise ConfigError (exit 2)."""
    from cocoon_ckpt.dp.plan import plan

    result = plan(
        target_epsilon=args.target_epsilon,
        delta=args.delta,
        dataset_size=args.dataset_size,
        batch_size=args.batch_size,
        steps=args.steps,
        bands=args.bands,
        mechanisms=tuple(args.mechanism or _DEFAULT_MECHANISMS),
        method=args.method,
        model_params=args.params,
    )
    print(result.to_json() if args.json else result.render())
    return 0
