"""Whether the process that left something behind still runs.

Leases and the far tier's folders name their owner by (host, pid, process start time):
a pid alone is reused by the kernel, the start time (clock ticks after boot, from
`/proc/<pid>/stat`) tells a reused pid from the original. Only a process on this host
can be judged this way; for another host the answer is "cannot tell" (None), and the
caller falls back on something else (a lease's expiry).
"""

from __future__ import annotations

import os
import socket

__all__ = ["available_memory", "owner_alive", "process_start", "this_host"]


def this_host() -> str:
    """This machine's host name, as owners record it."""
    return socket.gethostname()


def process_start(pid: int) -> str | None:
    """Process `pid`'s start time in clock ticks after boot, or None when it does not
    run (or /proc is absent)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            # the command name (field 2) may hold spaces and ')': split after the last ')'
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def owner_alive(host: object, pid: object, start: object) -> bool | None:
    """Whether the owner recorded as (`host`, `pid`, `start`) still runs.

    Args:
        host: the owner's host name.
        pid: its process id.
        start: its `process_start` (None when it was not recorded: any process with that
            pid counts as the owner).

    Returns:
        True or False for an owner on this host; None for one on another host (or with
        no host recorded), which cannot be judged from here.
    """
    if not isinstance(host, str) or host != this_host():
        return None
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it runs
    return start is None or process_start(pid) == start  # a reused pid is another process


def available_memory() -> int:
    """Memory the kernel could give without swapping (/proc/meminfo's MemAvailable),
    bytes; 0 where it does not say (not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
