"""`cocoon-ckpt`: the command line above all three packages (a thin layer over the API).

This module builds the top-level parser from each command module's `add_parser`,
dispatches to the handler the chosen subcommand set, and turns what the handler raised
into one line on stderr and the exit code `exits.EXIT_CODES` gives its class. Command
modules import torch and the tools inside their handlers, so `inspect`, `diff`, `gc`,
`--version` and `--help` start without torch or dp-accounting.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NoReturn, cast

from cocoon_ckpt._cli import audit, catalog, chaos, export, plan, train
from cocoon_ckpt._cli.args import LOG_LEVELS, Parser, check_url, log_level
from cocoon_ckpt._cli.exits import exit_code, message
from cocoon_ckpt._cli.train_config import field_default, flag_words
from cocoon_ckpt._version import VersionAction
from cocoon_ckpt.errors import PreemptedError
from cocoon_ckpt.train.config import JobConfig

if TYPE_CHECKING:
    from cocoon_ckpt._cli.args import Subparsers

__all__ = ["main", "parser"]

#: Each command module's `add_parser`, in the order `--help` lists the subcommands.
_COMMANDS: tuple[Callable[[Subparsers], None], ...] = (
    train.add_parser,
    export.add_parser,
    catalog.add_parsers,  # inspect, diff, gc
    audit.add_parser,
    chaos.add_parser,
    plan.add_parser,
)


def parser() -> argparse.ArgumentParser:
    """The `cocoon-ckpt` parser: global options and one subcommand per command, each
    setting `handler`, the function that runs it."""
    p = Parser(
        prog="cocoon-ckpt",
        description="Differentially private training with correlated noise that can crash "
        "anywhere and resume exactly.",
    )
    p.add_argument("--version", action=VersionAction)
    default_level = field_default(JobConfig, "log_level")
    p.add_argument(
        "--log-level",
        default=default_level,
        type=log_level,
        metavar="LEVEL",
        help=f"logging level: {', '.join(LOG_LEVELS)} (default {default_level}; DEBUG also "
        "prints the traceback of an unexpected error)",
    )
    sub = cast(
        "Subparsers",
        p.add_subparsers(dest="command", required=True),  # of Parser: one-line errors too
    )
    for add in _COMMANDS:
        add(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point. Exit codes: 0 ok; 1 the job or store refused, or audit findings;
    2 usage errors (bad arguments, not a store, a newer format, a missing version or
    key); 130 / 143 stopped by SIGINT / SIGTERM (after a checkpoint, when training);
    141 the reader of stdout left."""
    try:
        code = _main(argv)
        sys.stdout.flush()  # a closed pipe shows here, not at exit
        return code
    except BrokenPipeError as exc:
        # `cocoon-ckpt inspect URL | head`: the reader left; say nothing more
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return exit_code(exc)
    except KeyboardInterrupt as exc:
        print("cocoon-ckpt: interrupted", file=sys.stderr)
        return exit_code(exc)


def entry() -> NoReturn:
    """The process's entry (`cocoon-ckpt`, `python -m cocoon_ckpt`): `main()`, then exit
    with its code.

    A process in a torch.distributed group destroys the group it started
    (`train.distributed.end_process_group`), then leaves with `os._exit` once its output
    is flushed: gloo's threads, destroyed with the interpreter while the group was up,
    aborted a rank now and then after it had printed its (agreed) error ("terminate
    called without an active exception", exit -6: 2 of 30 runs of a 2-rank refusal).
    Everything a rank writes is committed and fsynced before `main` returns, so nothing
    is lost by skipping the interpreter's teardown."""
    code = main()
    if _in_process_group():
        from cocoon_ckpt.train.distributed import end_process_group

        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        with contextlib.suppress(Exception):  # the exit code is the job's, not this
            end_process_group()
        os._exit(code)
    sys.exit(code)


def _in_process_group() -> bool:
    dist = sys.modules.get("torch.distributed")
    return bool(dist is not None and dist.is_available() and dist.is_initialized())


def _main(argv: Sequence[str] | None) -> int:
    try:
        args = parser().parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error already printed
        return exc.code if isinstance(exc.code, int) else 2
    chaos.arm_crash_points()
    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s")
    handler = cast("Callable[[argparse.Namespace], int]", args.handler)
    try:
        _check_urls(args)
        return handler(args)
    except (BrokenPipeError, KeyboardInterrupt):
        raise
    except PreemptedError as exc:  # not an error: the job stopped where it can resume
        print(f"cocoon-ckpt: {message(exc)}", file=sys.stderr)
        return exit_code(exc)
    except Exception as exc:
        if args.log_level == "DEBUG":
            traceback.print_exc()
        text = _cli_words(message(exc), args.command)
        if args.command == "train" and getattr(args, "config", None) is None:
            text = flag_words(text)  # the user typed flags: name the flags, not fields
        print(f"cocoon-ckpt: error: {text}", file=sys.stderr)
        return exit_code(exc)


#: The commands that take `--allow-fallback`, which the store layer's messages name as
#: the API's `allow_fallback=True`.
_FALLBACK_FLAG = {"train": "--allow-fallback"}


def _cli_words(text: str, command: str) -> str:
    """`text` with the API's keywords named as `command`'s flags (the store layer says
    `open with allow_fallback=True`; `train` takes `--allow-fallback`). Where the command
    has no such flag, the hint is dropped from the line rather than naming one."""
    if "open with allow_fallback=True to use version" in text:
        flag = _FALLBACK_FLAG.get(command)
        if flag is None:
            text = re.sub(r"; open with allow_fallback=True to use version \d+", "", text)
        else:
            text = text.replace("open with allow_fallback=True", f"rerun with {flag}")
    return text


def _check_urls(args: argparse.Namespace) -> None:
    """Each store URL the command line names (a command's URL, train's --store) has a
    scheme fsspec knows (`args.check_url`)."""
    for dest, what in (("url", "URL"), ("store", "--store")):
        url = getattr(args, dest, None)
        if isinstance(url, str):
            check_url(url, what)


if __name__ == "__main__":
    sys.exit(main())
