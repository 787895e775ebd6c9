"""Code blocks of the docs, found by the HTML comment marker just above each
(`<!-- NAME -->`), so a test runs what a reader copies, not a copy of it."""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def block(page: str, marker: str) -> str:
    """The fenced code block right after `<!-- marker -->` on `page` (repo-relative)."""
    text = (ROOT / page).read_text()
    found = re.search(rf"<!-- {re.escape(marker)} -->\n```[a-z]*\n(.*?)```", text, re.S)
    assert found is not None, f"{page}: no code block under <!-- {marker} -->"
    return found.group(1)


def commands(text: str) -> list[list[str]]:
    """The shell commands of a block (backslash continuations joined, comments
    dropped), `cocoon-ckpt` run as this interpreter's `-m cocoon_ckpt`."""
    joined = text.replace("\\\n", " ")
    out = []
    for line in joined.splitlines():
        argv = shlex.split(line, comments=True)
        if not argv:
            continue
        if argv[0] == "cocoon-ckpt":
            argv = [sys.executable, "-m", "cocoon_ckpt", *argv[1:]]
        out.append(argv)
    return out
