"""A failure packed on one rank and unpacked on another is the same exception: its
class, `str()` and fields, an OSError's C fields (errno, strerror, file names) too."""

from __future__ import annotations

import errno
import os
import pickle
from pathlib import Path

import pytest

from cocoon_ckpt.errors import ConfigError
from cocoon_ckpt.train.rank_failure import packed, unpacked


def _sent(exc: BaseException) -> BaseException:
    """`exc` as another rank receives it (pickled, as torch's object collectives do)."""
    return unpacked(pickle.loads(pickle.dumps(packed(exc))))


def test_a_file_not_found_arrives_with_its_path(tmp_path: Path) -> None:
    missing = tmp_path / "nonexistent" / "x"
    with pytest.raises(FileNotFoundError) as caught:
        open(missing)  # noqa: SIM115  (the error is the point)
    got = _sent(caught.value)
    assert type(got) is FileNotFoundError and isinstance(got, OSError)
    assert str(got) == str(caught.value) and str(missing) in str(got)
    assert (got.errno, got.strerror, got.filename) == (
        errno.ENOENT,
        os.strerror(errno.ENOENT),
        str(missing),
    )


def test_a_rename_failure_keeps_both_file_names(tmp_path: Path) -> None:
    src, dst = tmp_path / "a", tmp_path / "nonexistent" / "b"
    with pytest.raises(OSError) as caught:
        os.rename(src, dst)
    got = _sent(caught.value)
    assert type(got) is type(caught.value) and isinstance(got, OSError)
    assert str(got) == str(caught.value)
    assert got.filename2 == str(dst)


def test_an_error_without_os_fields_is_unchanged() -> None:
    exc = ConfigError("DPConfig.bands=0 must be >= 1")
    got = _sent(exc)
    assert type(got) is ConfigError and str(got) == str(exc)
