"""docs/architecture.md and the other pages hold against the tree (#28 item 8): every
module has its line, the rooms' order is the import contract's, and no page sends a
reader to a file or a dotted name that is not there."""

from __future__ import annotations

import importlib
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ARCH = ROOT / "docs" / "architecture.md"
PAGES = sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]
PACKAGES = ("cocoon_ckpt", "state", "fault_injection")
# what a page may name as a file of this repository
REPO_PREFIXES = (*(p + "/" for p in PACKAGES), "bench/", "tests/", "examples/", "docs/")
REPO_PREFIXES += ("requirements/", ".ci/")


def _named(text: str, name: str) -> bool:
    return re.search(rf"(?<![\w]){re.escape(name)}(?![\w])", text) is not None


def test_every_module_has_its_line_in_architecture() -> None:
    text = ARCH.read_text()
    missing = []
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if path.name in ("__init__.py", "__main__.py"):
                continue
            rel = path.relative_to(ROOT)
            # a conformance suite's modules are the `testing/` row of their room
            if "testing" in rel.parts[:-1]:
                continue
            if not _named(text, path.stem):
                missing.append(str(rel))
    assert missing == [], f"add a line to docs/architecture.md for {missing}"


def test_the_rooms_order_is_the_layers_contract() -> None:
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    rooms = next(
        c["layers"] for c in contracts["contracts"] if c.get("containers") == ["cocoon_ckpt"]
    )
    drawn = re.search(r"^(_cli\s+>.*)$", ARCH.read_text(), re.M)
    assert drawn is not None, "docs/architecture.md lost its rooms line"
    order = [room.strip() for room in drawn.group(1).split(">")]
    assert order[:-1] == rooms[:-1] and order[-1] == "base"


def _mentions(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code blocks
    return re.findall(r"`([^`\s]+)`", text)


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_a_page_names_only_what_is_there(page: Path) -> None:
    gone = []
    for name in _mentions(page):
        name = name.split("::")[0].rstrip(".,;:")
        if name.startswith(REPO_PREFIXES):
            if not (ROOT / name).exists():
                gone.append(name)
        elif re.fullmatch(rf"({'|'.join(PACKAGES)})(\.\w+)+", name) and not _resolves(name):
            gone.append(name)
    assert gone == [], f"{page.relative_to(ROOT)} names what the tree does not hold: {gone}"
