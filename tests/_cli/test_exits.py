"""The exit-code table: each kind of error gets the code the CLI documents."""

from __future__ import annotations

import errno
import importlib

import pytest

from cocoon_ckpt._cli.exits import EXIT_CODES, FAILURE, Named, exit_code
from cocoon_ckpt.errors import ConfigError, ConfigMismatchError, NoiseKeyError, PreemptedError
from state import CorruptVersionError, NotAStoreError, VersionNotFoundError


def test_every_named_class_of_ours_exists() -> None:
    """A class the table names by module (not to import it at start-up) must stay there."""
    for key, _ in EXIT_CODES:
        if isinstance(key, Named) and not key.module.startswith("botocore"):
            assert isinstance(getattr(importlib.import_module(key.module), key.name), type), key


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (PreemptedError("stopped", signum=15, step=3, version=1), 143),
        (PreemptedError("stopped", signum=2, step=None, version=None), 130),
        (KeyboardInterrupt(), 130),
        (BrokenPipeError(), 141),
        (ConfigError("bad flag"), 2),
        (NoiseKeyError("chmod 600"), 2),
        (NotAStoreError("not a store"), 2),
        (VersionNotFoundError("no version 9"), 2),
        (ConfigMismatchError("other job", []), 1),  # a CocoonError and a ValueError: refused
        (CorruptVersionError("checksum", version=3, path="v/3"), 1),
        (ValueError("--trials=0 must be >= 1"), 2),
        (FileNotFoundError(errno.ENOENT, "No such file", "x"), 2),
        (OSError(errno.ENOSPC, "No space left", "x"), FAILURE),
        (RuntimeError("not ours"), FAILURE),
    ],
)
def test_exit_code_by_error_class(exc: BaseException, code: int) -> None:
    assert exit_code(exc) == code


def test_export_path_error_is_a_usage_error() -> None:
    from cocoon_ckpt.tools.export import ExportPathError

    assert exit_code(ExportPathError("--out is inside the store")) == 2
