"""The installed distribution's version: one source, pyproject.toml's `version`.

Looked up on first use (the metadata scan of sys.path costs ~25 ms), so a CLI command
that never asks for it does not pay for it.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import Any

__all__ = ["VersionAction", "distribution_version"]

DISTRIBUTION = "cocoon-ckpt"


@functools.cache
def distribution_version() -> str:
    """The installed version of cocoon-ckpt (`0+unknown` when run from an uninstalled
    source tree)."""
    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:
        return "0+unknown"


def __getattr__(name: str) -> str:  # `cocoon_ckpt.__version__` loads from here
    if name == "__version__":
        return distribution_version()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class VersionAction(argparse.Action):
    """`--version`: print `<prog> <version>` to stdout and exit 0 (argparse's own
    `version` action needs the string when the parser is built)."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS) -> None:
        super().__init__(
            option_strings,
            dest,
            nargs=0,
            default=argparse.SUPPRESS,
            help="print the version and exit",
        )

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        print(f"{parser.prog} {distribution_version()}", file=sys.stdout)
        parser.exit(0)
