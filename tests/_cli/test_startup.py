"""The store-only commands start without torch, dp-accounting or fault_injection: the
command modules import them inside their handlers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from state import Store

HEAVY = ("torch", "dp_accounting", "numba", "matplotlib", "fault_injection")

CHECK = (
    "import sys\n"
    "from cocoon_ckpt._cli.main import main\n"
    "code = main(sys.argv[1:])\n"
    f"heavy = sorted(set({HEAVY!r}) & set(sys.modules))\n"
    "assert code == 0 and not heavy, (code, heavy)\n"
)


@pytest.mark.parametrize(
    "args",
    [
        ("--version",),
        ("--help",),
        ("inspect", "--help"),
        ("inspect", "URL"),
        ("gc", "URL", "--keep", "2"),
    ],
)
def test_store_only_commands_import_nothing_heavy(args: tuple[str, ...], tmp_path: Path) -> None:
    url = str(tmp_path / "s.zarr")
    Store.open(url)  # an empty store
    argv = [url if a == "URL" else a for a in args]
    res = subprocess.run(
        [sys.executable, "-c", CHECK, *argv], capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr
