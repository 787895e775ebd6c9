"""Numbers and data a job refuses before they can hurt it: a sigma, learning rate or lease
expiry outside its range, a scheduler or state the store cannot keep (all before the first
write), a non-finite per-sample gradient (at its step, naming the example), a model with
non-finite parameters at export; and a key file that a failed write does not leave half
made."""

from __future__ import annotations

import errno
import hashlib
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from cocoon_ckpt._cli.main import main
from cocoon_ckpt.keys import KEY_BYTES, create_key_file

SMALL = (
    *("--steps", "4", "--bands", "2", "--checkpoint-every", "2", "--no-progress"),
    *("--dataset-size", "256", "--batch-size", "16"),
)


def _tree_hash(root: Path) -> str:
    """One hash of every path and file's bytes under `root` ('' where nothing is)."""
    if not root.exists():
        return ""
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        h.update(str(p.relative_to(root)).encode() + b"\0")
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


def _one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    out, err = capsys.readouterr()
    lines = [ln for ln in err.splitlines() if ln.startswith("cocoon-ckpt")]
    assert len(lines) == 1 and lines[0].startswith("cocoon-ckpt: error: "), err
    return lines[0]


# key file ------------------------------------------------------------------------------


def _failing_write_to(path: Path, real: Callable[[int, bytes], int]) -> Callable[..., int]:
    """os.write that fails with ENOSPC on the file at `path` (a full disk), and writes
    every other file as it would."""
    target = os.path.realpath(path)

    def write(fd: int, data: bytes) -> int:
        try:
            name = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            name = ""
        if name == target:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data)

    return write


def test_a_key_file_on_a_full_disk_is_removed_and_the_rerun_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    store, key = tmp_path / "s.zarr", tmp_path / "noise.key"
    argv = ["train", "--store", str(store), "--key-file", str(key), *SMALL]
    monkeypatch.setattr(os, "write", _failing_write_to(key, os.write))
    assert main(argv) == 1
    assert "No space left on device" in _one_error_line(capsys)
    assert not key.exists()  # no 0-byte key to refuse the rerun
    monkeypatch.undo()
    assert main(argv) == 0
    assert key.stat().st_size == KEY_BYTES
    assert sorted(p.name for p in (store / "manifests").iterdir()) == [
        "00000001.json",
        "00000002.json",
    ]


def test_a_key_file_past_the_file_size_limit_is_removed(tmp_path: Path) -> None:
    # a real short write, then EFBIG: the file size limit stands in for a full disk
    key = tmp_path / "noise.key"
    code = textwrap.dedent(
        f"""
        import resource, signal, sys
        from cocoon_ckpt.keys import create_key_file
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (16, 16))
        try:
            create_key_file({str(key)!r}, bytes(range(32)))
        except OSError as exc:
            print(exc.errno)
            sys.exit(3)
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, done.stderr
    assert int(done.stdout) == errno.EFBIG
    assert not key.exists()


def test_create_key_file_writes_the_whole_key_0600_and_never_overwrites(tmp_path: Path) -> None:
    key = tmp_path / "noise.key"
    create_key_file(str(key), bytes(range(32)))
    assert key.read_bytes() == bytes(range(32))
    assert key.stat().st_mode & 0o777 == 0o600
    with pytest.raises(FileExistsError):
        create_key_file(str(key), bytes(32))
    assert key.read_bytes() == bytes(range(32))  # the existing key stays
