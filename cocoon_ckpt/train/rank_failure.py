"""A failure on one rank of a torch.distributed job, raised again on every other rank as
itself: the same class, arguments and attributes, and the errors it wraps, so every rank
prints the same line and exits with the same code (`_cli.exits` picks the code from the
class, and for some classes from the error it was raised from: s3fs re-raises botocore's
credential errors as its own).

Plain pickling of an exception calls its class with `args` alone, which breaks classes
whose `__init__` takes more (`ConfigMismatchError(message, differences)`); the class,
`args` and attributes travel instead, and the copy is made without calling `__init__`.
An OSError's errno, strerror and file names are C fields, not in its `__dict__`: they
travel as attributes too, so its line keeps the path. Plain pickling also drops
`__cause__` and `__context__`; they travel the same way, up to `CHAIN_DEPTH` deep.
"""

from __future__ import annotations

import pickle
from typing import Any, NamedTuple

from cocoon_ckpt.errors import ConfigError

__all__ = ["CHAIN_DEPTH", "Failure", "packed", "unpacked"]

#: Wrapped errors kept below the failure itself (`raise ... from` chains are short; the
#: bound keeps a pathological chain from flooding the collective).
CHAIN_DEPTH = 4

#: An OSError's fields outside its `__dict__` (`str()` reads them).
_OS_FIELDS = ("errno", "strerror", "filename", "filename2")


class Failure(NamedTuple):
    """What travels between ranks."""

    cls: type[BaseException]
    args: tuple[Any, ...]
    attrs: dict[str, Any]
    """The instance's attributes (an OSError's C fields included)."""
    cause: Failure | None = None
    """`__cause__`, packed (`raise ... from`)."""
    context: Failure | None = None
    """`__context__`, packed (raised while handling it)."""
    suppress_context: bool = False


def packed(exc: BaseException, depth: int = CHAIN_DEPTH) -> Failure:
    """`exc` as it can be sent to another rank. A class or attribute that cannot be
    pickled (a job's local class) travels as its text, under a class the CLI gives the
    same exit code: ConfigError for a ValueError (2), RuntimeError otherwise (1)."""
    attrs = dict(getattr(exc, "__dict__", {}))
    if isinstance(exc, OSError):
        attrs.update((n, v) for n in _OS_FIELDS if (v := getattr(exc, n)) is not None)

    def inner(e: BaseException | None) -> Failure | None:
        return packed(e, depth - 1) if depth > 0 and e is not None else None

    own = (type(exc), tuple(exc.args), attrs)
    try:
        pickle.loads(pickle.dumps(own))
    except Exception:  # whatever pickling raises, the text still travels
        text = f"{type(exc).__name__}: {exc}"
        own = (ConfigError if isinstance(exc, ValueError) else RuntimeError, (text,), {})
    return Failure(
        *own,
        cause=inner(exc.__cause__),
        context=inner(exc.__context__),
        suppress_context=exc.__suppress_context__,
    )


def unpacked(failure: Failure) -> BaseException:
    """The exception `packed` sent: of its class, with its args and attributes, and the
    errors it wrapped."""
    cls, args, attrs = failure.cls, failure.args, failure.attrs
    exc = cls.__new__(cls, *args)
    exc.args = args
    for name, value in attrs.items():
        setattr(exc, name, value)  # not __dict__: an OSError's fields are C slots
    if failure.cause is not None:
        exc.__cause__ = unpacked(failure.cause)
    if failure.context is not None:
        exc.__context__ = unpacked(failure.context)
    exc.__suppress_context__ = failure.suppress_context
    return exc
