"""What an error means to the shell: its exit code, from one table keyed by error class,
and the one line that says what went wrong.

Exit codes, by what happened: 0 ok; 2 the request was malformed (`RequestError`: bad
arguments, config or job, a missing or wrong key, not a store, a newer format, a missing
version, a wrong output path); 1 a valid request the state of the store refused
(`RefusedError`, `StoreError`), or audit and chaos findings; 3 a valid request that
failed while it ran (`RunError`, an environment failure, anything unexpected); 128 + N
stopped by signal N (130 Ctrl-C, 141 a closed pipe, 143 SIGTERM).
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import sysconfig
import traceback
from collections.abc import Callable
from dataclasses import dataclass

from cocoon_ckpt.errors import CocoonError, PreemptedError, RefusedError, RequestError, RunError
from state import FormatVersionError, StoreError, StoreNotFoundError, VersionNotFoundError

__all__ = ["EXIT_CODES", "FAILURE", "Named", "exit_code", "message", "user_frame"]


@dataclass(frozen=True, slots=True)
class Named:
    """An error class named by module and name, for modules the CLI must not import to
    start (torch-using tools, the optional botocore): it matches only once its module is
    imported, and an error of a module never imported cannot be in flight."""

    module: str
    """Dotted module path, e.g. `botocore.exceptions`."""
    name: str
    """The class name in that module."""
    wrapped: bool = False
    """Also match when the error was raised from (or while handling) one of this class:
    s3fs re-raises botocore's errors as its own."""

    def matches(self, exc: BaseException) -> bool:
        """Whether `exc` (or, if `wrapped`, the error it wraps) is of this class."""
        cls = getattr(sys.modules.get(self.module), self.name, None)
        if not isinstance(cls, type):
            return False
        chain = (exc, exc.__cause__, exc.__context__) if self.wrapped else (exc,)
        return any(isinstance(e, cls) for e in chain)


#: A row's code: an int, or a function of the error that returns None to pass it on.
Code = int | Callable[[BaseException], int | None]

#: OS errors about a path the user named (exit 2): missing, not a folder, too long.
_PATH_ERRNOS = frozenset(
    {errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.ENAMETOOLONG, errno.ELOOP, errno.EACCES}
)


def _signal(exc: BaseException) -> int | None:
    return 128 + exc.signum if isinstance(exc, PreemptedError) else None


def _path(exc: BaseException) -> int | None:
    return 2 if isinstance(exc, OSError) and exc.errno in _PATH_ERRNOS else None


_NO_CREDENTIALS = (
    Named("botocore.exceptions", "NoCredentialsError", wrapped=True),
    Named("botocore.exceptions", "PartialCredentialsError", wrapped=True),
)
_UNREACHABLE = (
    Named("botocore.exceptions", "EndpointConnectionError", wrapped=True),
    Named("botocore.exceptions", "ConnectTimeoutError", wrapped=True),
    Named("botocore.exceptions", "ConnectionClosedError", wrapped=True),
)

#: A valid request that failed while it ran: `RunError`, and whatever no row decides.
FAILURE = 3

#: The first row the error is an instance of decides its exit code (order matters: our
#: errors also derive from the builtin their callers catch, e.g. ConfigError is a
#: ValueError, so the families come before the builtins); an error no row decides exits
#: with FAILURE.
EXIT_CODES: tuple[tuple[type[BaseException] | Named, Code], ...] = (
    (PreemptedError, _signal),  # after a checkpoint: rerunning resumes
    (KeyboardInterrupt, 128 + signal.SIGINT),
    (BrokenPipeError, 141),  # 128 + SIGPIPE (not defined on Windows): the reader left
    # the request was malformed
    (RequestError, 2),
    (StoreNotFoundError, 2),  # and NotAStoreError: a file, a user folder, a plain zarr group
    (FormatVersionError, 2),
    (VersionNotFoundError, 2),
    # a valid request the state of the store refused
    (RefusedError, 1),
    (StoreError, 1),
    # a valid request that failed while it ran
    (RunError, FAILURE),
    (CocoonError, FAILURE),
    # the builtins a bad argument raises deeper down
    (ValueError, 2),
    (OSError, _path),
    *((named, 2) for named in _NO_CREDENTIALS),
)


def exit_code(exc: BaseException) -> int:
    """The exit code of a command that raised `exc` (see the module docstring)."""
    for key, code in EXIT_CODES:
        if key.matches(exc) if isinstance(key, Named) else isinstance(exc, key):
            decided = code if isinstance(code, int) else code(exc)
            if decided is not None:
                return decided
    return FAILURE


def message(exc: BaseException) -> str:
    """One line saying what went wrong and, where we know it, what to do."""
    if any(n.matches(exc) for n in _NO_CREDENTIALS):
        return (
            f"no usable S3 credentials ({exc}); set AWS_ACCESS_KEY_ID and "
            'AWS_SECRET_ACCESS_KEY (or a profile), or pass "key"/"secret" in '
            "--storage-options"
        )
    if any(n.matches(exc) for n in _UNREACHABLE):
        return f"cannot reach the storage endpoint ({exc}); check endpoint_url in --storage-options"
    if isinstance(exc, OSError) and exc.strerror and exc.filename is not None:
        path = str(exc.filename)
        path = path if len(path) <= 120 else path[:60] + "..." + path[-40:]
        return f"{path}: {exc.strerror}"
    text = str(exc) or type(exc).__name__
    notes = []
    where = user_frame(exc)
    if where is not None:  # raised in, or under, the user's code: where to look
        notes.append(f"at {where}")
    if not isinstance(exc, (CocoonError, StoreError, ValueError, OSError)):
        # not one of ours: name the class, and where the details are
        text = f"{type(exc).__name__}: {text}"
        notes.append("--log-level DEBUG prints the traceback")
    if notes:
        text = f"{text} ({'; '.join(notes)})"
    return " ".join(text.split())  # one line, whatever the message holds


def _library_roots() -> tuple[str, ...]:
    """Folders whose files are not the user's: ours, the standard library, installed
    packages."""
    ours = (sys.modules.get(n) for n in ("cocoon_ckpt", "state", "fault_injection"))
    roots = [os.path.dirname(m.__file__) for m in ours if m is not None and m.__file__]
    paths = sysconfig.get_paths()
    roots += [paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths]
    return tuple(os.path.realpath(r) + os.sep for r in roots)


def user_frame(exc: BaseException) -> str | None:
    """`FILE:LINE in FUNCTION` of the innermost frame of `exc`'s traceback in the user's
    code (a job builder, a Dataset), not ours, the standard library's or an installed
    package's: where a user looks first. None when no frame is the user's."""
    roots = _library_roots()
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        name = frame.filename
        if name.startswith("<") or os.path.realpath(name).startswith(roots):
            continue
        return f"{name}:{frame.lineno} in {frame.name}"
    return None
