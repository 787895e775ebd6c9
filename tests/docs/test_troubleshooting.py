"""docs/troubleshooting.md has a row for every error class of `cocoon_ckpt.errors` and
`state.errors`, with its exit code as the CLI gives it."""

from __future__ import annotations

import re

import cocoon_ckpt.errors
import state.errors
from cocoon_ckpt._cli.exits import exit_code

from .blocks import ROOT


def test_every_error_class_has_a_row_with_its_exit_code() -> None:
    text = (ROOT / "docs" / "troubleshooting.md").read_text()
    rows = dict(re.findall(r"^\| `(\w+)` \| ([\w +]+) \|", text, re.M))
    for module in (cocoon_ckpt.errors, state.errors):
        for name in module.__all__:
            assert name in rows, f"docs/troubleshooting.md: no row for {name}"
            cls = getattr(module, name)
            if rows[name].strip().isdigit():
                exc = cls.__new__(cls)  # the exit code depends on the class alone
                Exception.__init__(exc, "x")
                assert exit_code(exc) == int(rows[name]), name
