"""The far-memory worker process: near-memory compute for the emulated CXL tier.

Run as `python -m cocoon_ckpt.tiers._far_worker`. It opens the tier's history file
read-only, receives only commands on stdin (the mixing vector itself lies in a shared
memory file), computes the GEMV next to its data with the fixed-order kernel, streaming
the file in column chunks (`far_io.stream_gemv`: its resident memory stays two chunks,
whatever the shard's size), writes the partial result into the shared output file,
models the link by holding the reply until (mix + result bytes) / bandwidth has passed,
and answers one JSON line. It imports numpy and `cocoon_ckpt.dp.gemv` only. EOF on
stdin (its owner died) ends it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import numpy as np

from cocoon_ckpt.tiers.far_io import private_file, stream_gemv, write_at


def _link_wait(start: float, nbytes: int, bandwidth: float | None) -> float:
    """Hold until `nbytes` could have crossed a link of `bandwidth` bytes/s since `start`."""
    if not bandwidth:
        return 0.0
    due = start + nbytes / bandwidth
    now = time.perf_counter()
    if due > now:
        time.sleep(due - now)
    return nbytes / bandwidth


def main() -> None:
    ring: int | None = None
    shape = (0, 0)
    mix: Any = None
    out: Any = None
    bandwidth: float | None = None
    reply = sys.stdout
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "open":
            dt = np.dtype(cmd["dtype"])
            shape = (int(cmd["slots"]), int(cmd["width"]))
            if ring is not None:
                os.close(ring)
            ring = os.open(cmd["path"], os.O_RDONLY)
            mix = np.memmap(cmd["mix_path"], dtype=dt, mode="r", shape=(shape[0],))
            out = np.memmap(cmd["out_path"], dtype=dt, mode="r+", shape=(shape[1],))
            bandwidth = cmd.get("link_bytes_per_s")
            res: dict[str, Any] = {"ok": True, "pid": os.getpid()}
        elif op == "gemv":
            if ring is None:
                res = {"ok": False, "error": "gemv before open"}
            else:
                t0 = time.perf_counter()
                if cmd.get("pre_delay_s"):
                    time.sleep(float(cmd["pre_delay_s"]))  # fault tests: die mid-GEMV
                stream_gemv(ring, np.array(mix), shape[0], shape[1], out)
                compute = time.perf_counter() - t0
                link = _link_wait(time.perf_counter(), mix.nbytes + out.nbytes, bandwidth)
                res = {"ok": True, "seq": cmd["seq"], "compute_s": compute, "link_s": link}
        elif op == "profile":
            dt = np.dtype(cmd["dtype"])
            slots, width = int(cmd["slots"]), int(cmd["width"])
            fd = private_file(cmd["path"], slots * width * dt.itemsize)
            try:
                rows = np.random.default_rng(0).standard_normal((slots, width)).astype(dt)
                write_at(fd, rows, 0)
                m = np.ones(slots, dtype=dt)
                o = np.empty(width, dtype=dt)
                stream_gemv(fd, m, slots, width, o)  # warm
                os.fdatasync(fd)
                times = []
                for _ in range(int(cmd["reps"])):
                    # from the file's medium, not the page cache: a far file on disk is
                    # planned at the disk's speed (a ring beyond RAM cannot stay cached);
                    # on tmpfs the pages are the memory and stay
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    t0 = time.perf_counter()
                    stream_gemv(fd, m, slots, width, o)
                    _link_wait(
                        time.perf_counter(), m.nbytes + o.nbytes, cmd.get("link_bytes_per_s")
                    )
                    times.append(time.perf_counter() - t0)
            finally:
                os.close(fd)
                os.unlink(cmd["path"])
            res = {"ok": True, "times": times}
        elif op == "exit":
            return
        else:
            res = {"ok": False, "error": f"unknown op {op!r}"}
        reply.write(json.dumps(res) + "\n")
        reply.flush()


if __name__ == "__main__":
    main()
