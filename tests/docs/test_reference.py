"""The API reference (docs/reference/, built by `mkdocs build --strict`) documents every
public name of `cocoon_ckpt` and `state`, their `__all__`, and names nothing else."""

from __future__ import annotations

import re
from pathlib import Path

import cocoon_ckpt
import state

REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "reference"


def _directives() -> set[str]:
    found: set[str] = set()
    for page in REFERENCE.glob("*.md"):
        found |= set(re.findall(r"^::: ([\w.]+)\s*$", page.read_text(), re.M))
    return found


def test_every_public_name_is_in_the_reference() -> None:
    public = {f"{m.__name__}.{n}" for m in (cocoon_ckpt, state) for n in m.__all__}
    documented = _directives()
    missing = sorted(public - documented)
    assert missing == [], f"add '::: NAME' lines to docs/reference/ for {missing}"
    stale = sorted(documented - public)
    assert stale == [], f"docs/reference/ names what is not in __all__: {stale}"
