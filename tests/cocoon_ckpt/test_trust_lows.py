"""#29's low-severity defects that had no test of their own: a path-like `--job`, key
files of the wrong size or kind named truly, and far-tier files private whatever the
umask."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cocoon_ckpt.errors import ConfigError
from cocoon_ckpt.tiers.far import FarTier
from cocoon_ckpt.train.parts import resolve

ROOT = Path(__file__).resolve().parents[2]


def _train(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cocoon_ckpt", "train", "--store", "s.zarr", "--quiet", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


@pytest.mark.parametrize("job", ["../evil:build", "/tmp/evil:build", "a-b:build", "x..y:f"])
def test_a_job_that_is_not_a_module_name_is_refused_by_name(job: str) -> None:
    with pytest.raises(ConfigError, match=r"is not a module name \(dotted Python identifiers"):
        resolve(job, search_cwd=True)


def test_a_relative_py_path_in_job_is_explained_not_a_type_error() -> None:
    with pytest.raises(ConfigError, match=r"names a file; name its module instead: evil:build"):
        resolve("../evil.py:build", search_cwd=True)


def test_key_files_of_the_wrong_size_or_kind_are_named_as_they_are(tmp_path: Path) -> None:
    big = tmp_path / "big.key"
    big.write_bytes(os.urandom(100))
    big.chmod(0o600)
    folder = tmp_path / "keys"
    folder.mkdir()
    for key, said in ((big, "holds 100 bytes, not a 32-byte key"), (folder, "is a folder")):
        run = _train(tmp_path, "--key-file", str(key))
        assert run.returncode == 2, run.stderr
        assert run.stderr.count("\n") == 1 and said in run.stderr, run.stderr
        assert not (tmp_path / "s.zarr").exists()


def test_far_tier_files_are_private_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        far = FarTier(1 << 20, folder=str(tmp_path))
        try:
            far.allocate(4, 64, np.float32)
            folders = (tmp_path, Path(far._shm))  # the history, and the worker's I/O
            files = [p for f in folders for p in f.rglob("*") if p.is_file()]
            assert any(p.name == "history" for p in files)
            for p in files:
                assert stat.S_IMODE(p.stat().st_mode) == 0o600, p
        finally:
            far.close()
    finally:
        os.umask(old)
