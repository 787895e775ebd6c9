"""`--job` beside an installed package of the same top-level name (Opacus installs a
regular `examples` package into site-packages): the repository's examples still
resolve, and a user's namespace folder hidden by such a package is named as such."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from cocoon_ckpt.errors import ConfigError
from cocoon_ckpt.train.parts import resolve

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A site-packages stand-in at the end of sys.path; the modules imported meanwhile
    are forgotten afterwards."""
    site = tmp_path / "site-packages"
    site.mkdir()
    monkeypatch.syspath_prepend(str(ROOT))  # keeps sys.path restored by monkeypatch
    sys.path.remove(str(ROOT))
    sys.path.append(str(site))
    before = set(sys.modules)
    for name in [n for n in sys.modules if n == "examples" or n.startswith("examples.")]:
        monkeypatch.delitem(sys.modules, name)
    yield site
    for name in set(sys.modules) - before:
        del sys.modules[name]


def _package(site: Path, name: str) -> None:
    (site / name).mkdir()
    (site / name / "__init__.py").write_text("WHO = 'installed'\n")


def test_the_repository_examples_win_over_an_installed_examples_package(
    installed: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _package(installed, "examples")
    monkeypatch.chdir(ROOT)
    builder = resolve("examples.digits.run:build", search_cwd=True)
    assert Path(sys.modules[builder.__module__].__file__ or "") == ROOT / "examples/digits/run.py"
    assert not hasattr(sys.modules["examples"], "WHO")


def test_a_namespace_folder_hidden_by_an_installed_package_is_named(
    installed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _package(installed, "myjobs")
    work = tmp_path / "work"
    (work / "myjobs").mkdir(parents=True)
    (work / "myjobs" / "train.py").write_text("def build(config):\n    return None\n")
    monkeypatch.chdir(work)
    with pytest.raises(ConfigError) as caught:
        resolve("myjobs.train:build", search_cwd=True)
    message = str(caught.value)
    assert str(installed / "myjobs" / "__init__.py") in message
    assert f"hides the folder {work / 'myjobs'}" in message
    assert "add an empty myjobs/__init__.py" in message
    (work / "myjobs" / "__init__.py").write_text("")
    for name in [n for n in sys.modules if n == "myjobs" or n.startswith("myjobs.")]:
        del sys.modules[name]
    assert resolve("myjobs.train:build", search_cwd=True).__module__ == "myjobs.train"
