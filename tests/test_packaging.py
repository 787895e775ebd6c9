"""Packaging that fits the ecosystem: the version has one source, the license is an SPDX
expression with its text shipped, matplotlib is an extra whose absence is named, every
package is typed, and the pytest plugin costs other projects nothing at start-up."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import tomllib
from pathlib import Path

import cocoon_ckpt

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _python(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120
    )


def test_the_pytest_plugin_imports_neither_torch_nor_zarr() -> None:
    """pytest loads the plugin in every run of every project in the environment."""
    res = _python(
        "import sys, fault_injection.pytest_plugin\n"
        "heavy = sorted({'torch', 'zarr', 'numpy', 'fsspec'} & set(sys.modules))\n"
        "assert not heavy, heavy"
    )
    assert res.returncode == 0, res.stderr


def test_version_flag_prints_the_pyproject_version() -> None:
    want = PYPROJECT["project"]["version"]
    assert cocoon_ckpt.__version__ == importlib.metadata.version("cocoon-ckpt") == want
    res = subprocess.run(
        [sys.executable, "-m", "cocoon_ckpt", "--version"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (res.returncode, res.stdout, res.stderr) == (0, f"cocoon-ckpt {want}\n", "")


def test_audit_plot_without_matplotlib_is_refused_naming_the_extra(tmp_path: Path) -> None:
    """Refused before the audit starts (the empty folder is not even opened as a store),
    exit 2, one line that says how to install it; nothing is written."""
    plots = tmp_path / "plots"
    res = _python(
        "import sys\n"
        "sys.modules['matplotlib'] = None  # as if the plots extra were not installed\n"
        "from cocoon_ckpt._cli.main import main\n"
        "sys.exit(main(sys.argv[1:]))",
        "audit",
        str(tmp_path),
        "--plot",
        str(plots),
    )
    assert res.returncode == 2, res.stderr
    assert res.stdout == ""
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and "need matplotlib" in lines[0], res.stderr
    assert lines[0].endswith("install the plots extra: pip install 'cocoon-ckpt[plots]'")
    assert not plots.exists()


def test_metadata_license_extras_and_typed_packages() -> None:
    meta = importlib.metadata.metadata("cocoon-ckpt")
    assert meta["License-Expression"] == "Apache-2.0"
    assert "LICENSE" in (meta.get_all("License-File") or [])
    assert (ROOT / "LICENSE").read_text().split()[:4] == ["Apache", "License", "Version", "2.0,"]
    requires = meta.get_all("Requires-Dist") or []
    assert [r for r in requires if r.startswith("matplotlib")] == [
        'matplotlib>=3.8; extra == "plots"',
        'matplotlib>=3.8; extra == "test"',
    ]
    # s3fs before 2024.12 silently drops the exclusive create that a commit relies on
    assert "fsspec>=2024.12" in requires and 's3fs>=2024.12; extra == "s3"' in requires
    for package in ("state", "cocoon_ckpt", "fault_injection"):
        assert (ROOT / package / "py.typed").is_file(), package
    assert "py.typed" in PYPROJECT["tool"]["setuptools"]["package-data"]["*"]
