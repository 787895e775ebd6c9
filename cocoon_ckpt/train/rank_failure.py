"""A failure on one rank of a torch.distributed job, raised again on every other rank as
itself: the same class, arguments and attributes, so every rank prints the same line and
exits with the same code (`_cli.exits` picks the code from the class).

Plain pickling of an exception calls its class with `args` alone, which breaks classes
whose `__init__` takes more (`ConfigMismatchError(message, differences)`); the class,
`args` and attributes travel instead, and the copy is made without calling `__init__`.
An OSError's errno, strerror and file names are C fields, not in its `__dict__`: they
travel as attributes too, so its line keeps the path.
"""

from __future__ import annotations

import pickle
from typing import Any

from cocoon_ckpt.errors import ConfigError

__all__ = ["Failure", "packed", "unpacked"]

#: What travels between ranks: the class, its `args`, its attributes.
Failure = tuple[type[BaseException], tuple[Any, ...], dict[str, Any]]

#: An OSError's fields outside its `__dict__` (`str()` reads them).
_OS_FIELDS = ("errno", "strerror", "filename", "filename2")


def packed(exc: BaseException) -> Failure:
    """`exc` as it can be sent to another rank. A class or attribute that cannot be
    pickled (a job's local class) travels as its text, under a class the CLI gives the
    same exit code: ConfigError for a ValueError (2), RuntimeError otherwise (1)."""
    attrs = dict(getattr(exc, "__dict__", {}))
    if isinstance(exc, OSError):
        attrs.update((n, v) for n in _OS_FIELDS if (v := getattr(exc, n)) is not None)
    failure: Failure = (type(exc), tuple(exc.args), attrs)
    try:
        pickle.loads(pickle.dumps(failure))
    except Exception:  # whatever pickling raises, the text still travels
        text = f"{type(exc).__name__}: {exc}"
        return (ConfigError if isinstance(exc, ValueError) else RuntimeError, (text,), {})
    return failure


def unpacked(failure: Failure) -> BaseException:
    """The exception `packed` sent: of its class, with its args and attributes."""
    cls, args, attrs = failure
    exc = cls.__new__(cls, *args)
    exc.args = args
    for name, value in attrs.items():
        setattr(exc, name, value)  # not __dict__: an OSError's fields are C slots
    return exc
