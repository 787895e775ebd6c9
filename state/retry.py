"""Bounded, jittered retries of idempotent storage operations (tenacity)."""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable
from typing import TypeVar

from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    wait_random_exponential,
)

__all__ = ["RetryPolicy", "is_transient"]

log = logging.getLogger(__name__)
T = TypeVar("T")

_TRANSIENT_ERRNOS = {
    errno.EAGAIN,
    errno.EBUSY,
    errno.ETIMEDOUT,
    errno.ECONNRESET,
    errno.ECONNABORTED,
    errno.ECONNREFUSED,
    errno.EINTR,
}
_TRANSIENT_WORDS = ("slowdown", "throttl", "timeout", "timed out", "503", "serviceunavailable")


def is_transient(exc: BaseException) -> bool:
    """True for errors worth retrying: timeouts, resets, throttling. Never for
    missing files, permission problems, a full disk or conflicts."""
    if isinstance(exc, (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError)):
        return False
    if isinstance(exc, (TimeoutError, ConnectionError)):
        return True
    if isinstance(exc, OSError) and exc.errno is not None:
        return exc.errno in _TRANSIENT_ERRNOS
    text = f"{type(exc).__name__} {exc}".lower()
    return isinstance(exc, OSError) and any(w in text for w in _TRANSIENT_WORDS)


def _log_retry(state: RetryCallState) -> None:
    exc = state.outcome.exception() if state.outcome else None
    log.warning("transient storage error (attempt %d), retrying: %r", state.attempt_number, exc)


class RetryPolicy:
    """How often and how long to retry a transient error.

    Args:
        attempts: total tries including the first (>= 1).
        max_wait_s: cap of the exponential, jittered back-off, seconds.
    """

    def __init__(self, attempts: int = 6, max_wait_s: float = 2.0) -> None:
        if attempts < 1:
            raise ValueError(f"RetryPolicy attempts={attempts} must be >= 1")
        if max_wait_s < 0:
            raise ValueError(f"RetryPolicy max_wait_s={max_wait_s} must be >= 0")
        self.attempts = attempts
        self.max_wait_s = max_wait_s

    def call(self, fn: Callable[[], T]) -> T:
        """Run `fn`, retrying only transient errors. `fn` must be idempotent."""
        retrying = Retrying(
            stop=stop_after_attempt(self.attempts),
            wait=wait_random_exponential(multiplier=0.02, max=self.max_wait_s),
            retry=retry_if_exception(is_transient),
            before_sleep=_log_retry,
            reraise=True,
        )
        return retrying(fn)
