"""A coalesced job whose CSC is larger than the RAM it is given, end to end (#32 item 3):
the real limit is a cgroup v1 memory controller's (root, /sys/fs/cgroup/memory).

    sudo python bench/csc_budget.py [--limit-mb 900] [--steps 160] [--rows 16000]
                                    [--dim 1024] [--batch 2048] [--window 4] [--threads 1]
                                    [--dir /tmp]

Runs `cocoon-ckpt train --example dlrm` (one table, flat ids, every row cold, so the CSC
holds an entry per read: 1.2 GB at the defaults) three times, each in a fresh
cgroup whose memory.limit_in_bytes (and memory.memsw.limit_in_bytes, no swap) is
--limit-mb, smaller than the CSC:

(a) with `--csc-window-steps W` to the end;
(b) the same job SIGKILLed (a real `os.kill`) once its first version is committed, then
    resumed under the same limit; its final model must equal (a)'s bit for bit (one
    `--key-file`, both exported and compared tensor by tensor);
(c) the same job without windows (the CSC held whole), which must not finish: killed by
    the OOM killer (exit -9, memory.failcnt > 0) or failing.

Prints the CSC's bytes (the job's own log line), the limit, each run's peak as its
cgroup saw it (memory.max_usage_in_bytes: page cache included) and its ru_maxrss
(anonymous and mapped pages of the process, shared libraries included), the largest
anonymous memory its cgroup held (memory.stat rss, sampled every 50 ms), the exit codes and the verdict; exits 1
when any check fails. The cgroups and the stores are removed at the end, on error too.

--threads 1 (the job's OMP_NUM_THREADS): the precompute then computes one tile at a time.
With two, `precompute._run_pool` keeps every finished tile's Future (and with it the
tile's entries) in its `futures` dict until the pool ends, so the precompute holds up to
the whole CSC (seen at 4,000 rows: RSS fell by 335 MB, about the 370 MB CSC, when the
pool returned). A tile is rows x all steps, so its entries grow with the steps: many
rows (--rows) keep each small. The precompute's peak is then the job's (about 700 MB of
anonymous memory here): at --limit-mb 700 the windowed job finished in 1 of 3 runs,
OOM-killed in its precompute in the others.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

CGROOT = Path("/sys/fs/cgroup/memory")
_CSC = re.compile(r"CSC of (\d+) bytes read in (\d+) windows of (\d+) steps, at most (\d+) bytes")


def _train(args: argparse.Namespace, store: Path, key: Path, window: int | None) -> list[str]:
    return [
        *(sys.executable, "-m", "cocoon_ckpt", "--log-level", "INFO", "train"),
        *("--example", "dlrm", "--embedding", "coalesced", "--threat-model", "final_model"),
        *("--hot-threshold", "1000000", "--job-option", f"tables=[{args.rows}]"),
        *("--job-option", f"dim={args.dim}", "--job-option", "dense=4"),
        *("--job-option", "zipf=0.5", "--store", str(store), "--key-file", str(key)),
        *("--steps", str(args.steps), "--checkpoint-every", str(args.steps // 3)),
        *("--bands", "8", "--batch-size", str(args.batch)),
        *("--dataset-size", str(16 * args.batch), "--physical-batch-size", "128"),
        *("--lr", "0.5", "--quiet"),
        *(("--csc-window-steps", str(window)) if window is not None else ()),
    ]


class Cgroup:
    """One cgroup v1 memory cgroup with a hard limit (no swap), removed by `remove`."""

    def __init__(self, name: str, limit: int) -> None:
        self.path = CGROOT / name
        self.path.mkdir()
        (self.path / "memory.limit_in_bytes").write_text(str(limit))
        self.peak_rss = 0
        memsw = self.path / "memory.memsw.limit_in_bytes"
        if memsw.exists():
            memsw.write_text(str(limit))

    def read(self, name: str) -> int:
        return int((self.path / name).read_text().split()[0])

    def oom_kills(self) -> int:
        for line in (self.path / "memory.oom_control").read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
        return -1

    def sample_rss(self, done: threading.Event) -> None:
        """Keep the largest anonymous memory (memory.stat rss) seen until `done`: the
        cgroup's own peak counts the page cache too, which the kernel reclaims."""
        while not done.is_set():
            stat = dict(
                line.split() for line in (self.path / "memory.stat").read_text().splitlines()
            )
            self.peak_rss = max(self.peak_rss, int(stat["rss"]))
            time.sleep(0.05)

    def remove(self) -> None:
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.2)  # its last process is still being reaped


def _run(
    cmd: list[str], cg: Cgroup, threads: int, kill_after_version: bool = False
) -> tuple[int, float, str]:
    """Run `cmd` inside `cg` (the child enters it before exec'ing), return its exit
    status (-N for signal N), its ru_maxrss in MB and its stderr. With
    kill_after_version, SIGKILL it once it logs its first committed version."""
    shell = f'echo $$ > {cg.path}/cgroup.procs && exec "$@"'
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.Popen(
        ["sh", "-c", shell, "sh", *cmd], stderr=subprocess.PIPE, text=True, env=env
    )
    assert proc.stderr is not None
    done = threading.Event()
    threading.Thread(target=cg.sample_rss, args=(done,), daemon=True).start()
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if kill_after_version and "committed version 1 " in line:
            os.kill(proc.pid, signal.SIGKILL)
            break
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    lines.extend(proc.stderr.readlines())
    done.set()
    return proc.returncode, usage.ru_maxrss / 1024, "".join(lines)


def _model(store: Path, key: Path, out: Path) -> dict[str, Any]:
    import torch

    cmd = [sys.executable, "-m", "cocoon_ckpt", "export", str(store), "--key-file", str(key)]
    subprocess.run([*cmd, "--out", str(out)], check=True, capture_output=True)
    model: dict[str, Any] = torch.load(out)
    return model


def main() -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--limit-mb", type=int, default=900)
    ap.add_argument("--steps", type=int, default=160)
    ap.add_argument("--rows", type=int, default=16_000)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--window", type=int, default=4, help="--csc-window-steps")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="OMP_NUM_THREADS of the job: its precompute computes this many tiles at once",
    )
    ap.add_argument("--dir", default=None, help="where the stores go (default: /tmp)")
    args = ap.parse_args()
    if not (CGROOT / "cgroup.procs").exists() or os.geteuid() != 0:
        print(f"no cgroup v1 memory controller writable at {CGROOT}: run as root there")
        return 1
    limit = args.limit_mb << 20
    tmp = Path(tempfile.mkdtemp(prefix="csc_budget_", dir=args.dir))
    key = tmp / "noise.key"
    groups: list[Cgroup] = []
    failed: list[str] = []

    def group(tag: str) -> Cgroup:
        groups.append(Cgroup(f"csc_budget_{os.getpid()}_{tag}", limit))
        return groups[-1]

    def report(tag: str, rc: int, maxrss: float, cg: Cgroup) -> None:
        print(
            f"{tag}: exit {rc}, cgroup peak {cg.read('memory.max_usage_in_bytes') / 2**20:.0f} "
            f"MB (limit {args.limit_mb} MB; page cache included), anonymous peak "
            f"{cg.peak_rss / 2**20:.0f} MB (sampled), ru_maxrss {maxrss:.0f} MB, failcnt "
            f"{cg.read('memory.failcnt')}, oom kills {cg.oom_kills()}",
            flush=True,
        )

    try:
        t0 = time.perf_counter()
        cg = group("a")
        rc, rss, err = _run(_train(args, tmp / "a.zarr", key, args.window), cg, args.threads)
        report(
            f"(a) windows of {args.window}, to the end ({time.perf_counter() - t0:.0f} s)",
            rc,
            rss,
            cg,
        )
        m = _CSC.search(err)
        if rc != 0 or m is None:
            print(err[-3000:])
            failed.append("(a) did not finish")
            return 1
        csc = int(m.group(1))
        print(
            f"CSC {csc / 2**20:.0f} MB ({csc} bytes) against a limit of {args.limit_mb} MB "
            f"({limit / csc:.2f}x the CSC); windows resident at most "
            f"{int(m.group(4)) / 2**20:.0f} MB",
            flush=True,
        )
        if csc <= limit:
            failed.append("the CSC is not larger than the limit")
        t0 = time.perf_counter()
        cg = group("b1")
        rc, rss, err = _run(_train(args, tmp / "b.zarr", key, args.window), cg, args.threads, True)
        report("(b) the same, SIGKILLed after its first version", rc, rss, cg)
        if rc != -signal.SIGKILL:
            print(err[-3000:])
            failed.append(f"(b) was not SIGKILLed (exit {rc})")
        cg = group("b2")
        rc, rss, err = _run(_train(args, tmp / "b.zarr", key, args.window), cg, args.threads)
        report(
            f"(b) resumed under the same limit ({time.perf_counter() - t0:.0f} s both)", rc, rss, cg
        )
        if rc != 0:
            print(err[-3000:])
            failed.append(f"(b)'s resume failed (exit {rc})")
        else:
            import torch

            a = _model(tmp / "a.zarr", key, tmp / "a.pt")
            b = _model(tmp / "b.zarr", key, tmp / "b.pt")
            same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
            print(f"(a) and (b)'s exported models: {'bit-identical' if same else 'DIFFER'}")
            if not same:
                failed.append("(b) differs from (a)")
        t0 = time.perf_counter()
        cg = group("c")
        rc, rss, err = _run(_train(args, tmp / "c.zarr", key, None), cg, args.threads)
        report(f"(c) the CSC held whole ({time.perf_counter() - t0:.0f} s)", rc, rss, cg)
        if rc == 0:
            failed.append("(c) finished: the limit did not bind")
        else:
            oom = cg.oom_kills() > 0 or (cg.oom_kills() < 0 and cg.read("memory.failcnt") > 0)
            why = "OOM-killed" if rc == -signal.SIGKILL and oom else "failed"
            last = err.strip().splitlines()[-1][:300] if err.strip() else "no message"
            print(f"(c) {why} ({last})")
    finally:
        for g in groups:
            g.remove()
        shutil.rmtree(tmp, ignore_errors=True)
        print("verdict: " + ("; ".join(failed) if failed else "all checks passed"), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
