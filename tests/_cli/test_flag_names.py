"""Every command-line flag the source names (in a message, a help text or a docstring) is
a flag of the `cocoon-ckpt` parsers, so no refusal tells a user to pass a flag the CLI
does not have. Read from the source itself, so a new message cannot regress it."""

from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path

import cocoon_ckpt
from cocoon_ckpt._cli.main import parser

#: `--flag` as a word: not inside another word or a longer dash run.
_FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9]*(?:-[a-z0-9]+)*")

#: Flags of other programs that messages name, each with that program's name, which must
#: appear in the same string for the flag to be read as its.
_FOREIGN = {"--pid": "py-spy"}


def _flags(p: argparse.ArgumentParser) -> set[str]:
    """The option strings of `p` and of every subcommand below it."""
    out: set[str] = set()
    for action in p._actions:
        out.update(s for s in action.option_strings if s.startswith("--"))
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out |= _flags(sub)
    return out


def _named_flags() -> list[tuple[str, int, str, str]]:
    """(file, line, flag, the string) for every flag a string literal of the package
    names (f-strings' literal parts included)."""
    root = Path(cocoon_ckpt.__file__).parent
    found: list[tuple[str, int, str, str]] = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                for flag in _FLAG.findall(node.value):
                    rel = str(path.relative_to(root.parent))
                    found.append((rel, node.lineno, flag, node.value))
    return found


def test_the_scan_sees_the_flags_messages_name() -> None:
    flags = {flag for _, _, flag, _ in _named_flags()}
    # a scan that found nothing would pass the test below vacuously
    assert {"--key-file", "--allow-fallback", "--store", "--takeover"} <= flags


def test_every_flag_the_source_names_exists() -> None:
    known = _flags(parser())
    wrong = [
        f"{path}:{line}: {flag}"
        for path, line, flag, text in _named_flags()
        if flag not in known and not (flag in _FOREIGN and _FOREIGN[flag] in text)
    ]
    assert wrong == [], "flags named in the source that no cocoon-ckpt parser has"
