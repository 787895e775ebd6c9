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


class _Local(Exception):
    """A class pickle can find, whose instance holds what it cannot pickle."""


def test_the_errors_it_wraps_arrive_too_and_decide_the_same_exit() -> None:
    """s3fs re-raises botocore's errors wrapped in its own, and the CLI takes the exit
    code and line of a credential error from the wrapped one: the other ranks need the
    chain too. (botocore comes with the test extra's s3fs and moto.)"""
    import botocore.exceptions as botocore

    from cocoon_ckpt._cli.exits import FAILURE, exit_code, message

    try:
        try:
            raise botocore.NoCredentialsError()
        except botocore.NoCredentialsError as inner:
            raise PermissionError("s3://bucket/store.zarr: access denied") from inner
    except PermissionError as exc:
        caught = exc
    got = _sent(caught)
    assert type(got.__cause__) is botocore.NoCredentialsError
    assert str(got.__cause__) == str(caught.__cause__)
    assert got.__suppress_context__ and caught.__suppress_context__
    assert exit_code(got) == exit_code(caught) == 2
    assert message(got) == message(caught) and "credentials" in message(got)
    # without the chain the copy would exit as a failure, with another line
    bare = unpacked(packed(caught)._replace(cause=None, context=None))
    assert exit_code(bare) == FAILURE


def test_a_context_is_kept_and_the_chain_is_bounded() -> None:
    def raised(n: int) -> BaseException:
        # level n raised while handling level n-1, down to a KeyError
        exc: BaseException = KeyError("level 0")
        for level in range(1, n + 1):
            try:
                try:
                    raise exc
                except BaseException:
                    raise ValueError(f"level {level}")  # noqa: B904  (the context is the point)
            except ValueError as new:
                exc = new
        return exc

    deep = raised(10)
    got = _sent(deep)
    levels = []
    e: BaseException | None = got
    while e is not None:
        levels.append(str(e))
        assert not e.__suppress_context__
        e = e.__context__
    assert levels == [f"level {n}" for n in range(10, 5, -1)]  # itself and CHAIN_DEPTH below
    try:
        try:
            raise KeyError("hidden")
        except KeyError:
            raise ConfigError("shown") from None
    except ConfigError as exc:
        quiet = _sent(exc)
    assert quiet.__suppress_context__ and quiet.__cause__ is None
    assert str(quiet.__context__) == "'hidden'"


def test_an_unpicklable_cause_travels_as_its_text() -> None:
    try:
        try:
            err = _Local("lock held")
            err.lock = __import__("threading").Lock()  # type: ignore[attr-defined]
            raise err
        except _Local as inner:
            raise ConfigError("could not start") from inner
    except ConfigError as exc:
        got = _sent(exc)
    assert type(got) is ConfigError and str(got) == "could not start"
    assert type(got.__cause__) is RuntimeError
    assert str(got.__cause__) == "_Local: lock held"
