"""The step right after an asynchronous checkpoint against the step right after none, as
alternating pairs (#31: a target is met when the median of >= 6 alternating pairs is at
or below it), and what the training thread does with the extra wall time.

    python bench/stall_pairs.py [--dim 8000000] [--bands 8] [--every 4] [--pairs 6]
        [--idle-writer] [--nice-writer] [--paced-writer] [--cadence N]
        [--torch-threads N]

bench/stall.py's job (the mlp example at ~`--dim` parameters) and its `async` case: a
`Checkpointer` with the lowered writer, k = `--every`. Each pair is the step right after
nothing (`plain`) and the step right after `save()` (`async`), each after k - 1 steps
that move the ring on as a job's would, in an order rotated every second pair and
reversed in odd ones (no mode always right after the same one); the pair's ratio is
async ÷ plain, and the median of the pairs' ratios is the figure. Every timed step is split by the kernel's own accounting of the training thread
(/proc/self/task/<tid>/schedstat): its CPU time, its time runnable but waiting for a core
(the writer and the machine's other load on the cores), and the rest, asleep (the GIL
held by another thread, a lock, I/O); beside it the CPU the other threads of the process
took during the step (the writer's, named apart), the machine's CPU time by kind and its
huge-page, compaction and direct-reclaim counters over the step, and the dirty and
writeback pages of the page cache when the step ends. `--idle-writer` adds a third step
to each pair, in turn: after a checkpoint of a second checkpointer whose writer thread runs
at SCHED_IDLE (a core only when no other thread wants it) instead of nice 10.
`async` is the library's default writer (nice 10, large files by O_DIRECT);
`--nice-writer` adds a step after a checkpoint whose writer runs at nice 10
(`checkpoint.BULK_IDLE = False`: the default's twin since SCHED_IDLE became an opt-in
again), `--paced-writer` one after a checkpoint written through
the page cache (the paced writer, `state.file_writes.DIRECT_BYTES = 0`) at nice 10: the
tree before O_DIRECT. The writer's CPU is its thread's and the background fsyncs'
(`state-fsync`). `--cadence N` then runs each writer in turn as a job would, N
checkpoints every k steps, and counts the `save()`s that found the last version still
in flight.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import threading
import time

from cocoon_ckpt import DPConfig, JobConfig
from cocoon_ckpt.format.metrics import TrainingMetrics
from cocoon_ckpt.train import checkpoint
from cocoon_ckpt.train.checkpoint import Checkpointer
from cocoon_ckpt.train.job_records import job_records
from cocoon_ckpt.train.runner import build_trainer
from state import Store, file_writes

DIRECT = file_writes.DIRECT_BYTES
BULK_IDLE = checkpoint.BULK_IDLE
_MATCH_STEPS = 200  # steps taken at most to reach a batch of the pair's size
_TICK = os.sysconf("SC_CLK_TCK")


def schedstat(tid: int) -> tuple[float, float]:
    """(seconds on a CPU, seconds runnable and waiting for one) of thread `tid`."""
    with open(f"/proc/self/task/{tid}/schedstat") as f:
        on, wait, _slices = f.read().split()
    return int(on) / 1e9, int(wait) / 1e9


def faults(tid: int) -> tuple[int, float]:
    """(page faults, minor and major, and seconds of system time) thread `tid` has taken."""
    with open(f"/proc/self/task/{tid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[7]) + int(fields[9]), int(fields[12]) / _TICK


def threads_cpu() -> dict[int, float]:
    """CPU seconds (user + system) of every thread of this process, by native id."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # a thread that ended
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / _TICK
    return out


_CPU_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def machine_cpu() -> dict[str, float]:
    """Seconds of the machine's CPUs, all summed, by kind (/proc/stat): `nice` is the
    niced threads' (the lowered writer's among them), `steal` what the host took from
    this VM."""
    with open("/proc/stat") as f:
        values = f.readline().split()[1:9]
    return {k: int(v) / _TICK for k, v in zip(_CPU_FIELDS, values, strict=True)}


_VMSTAT = (
    "thp_fault_alloc",
    "thp_fault_fallback",
    "compact_stall",
    "allocstall_movable",
    "pgsteal_direct",
    "pgfree",
)


def vmstat() -> dict[str, int]:
    """Machine-wide counters of /proc/vmstat: huge pages faulted in and fallen back from,
    direct compaction and reclaim (a thread allocating stalls in them), pages freed."""
    got = {}
    with open("/proc/vmstat") as f:
        for line in f:
            key, value = line.split()
            if key in _VMSTAT:
                got[key] = int(value)
    return got


def switches(tid: int) -> int:
    """Times thread `tid` was taken off a core while it could still run."""
    with open(f"/proc/self/task/{tid}/status") as f:
        for line in f:
            if line.startswith("nonvoluntary_ctxt_switches:"):
                return int(line.split()[1])
    return 0


def dirty_pages() -> tuple[int, int]:
    """(dirty, under writeback) bytes of the page cache, machine-wide."""
    got = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split(":")
            got[key] = int(value.split()[0]) * 1024
    return got["Dirty"], got["Writeback"]


class Sample:
    """One timed step: wall, and the training thread's CPU, run-queue wait, sleep and
    page faults."""

    def __init__(self, step: object, writing: bool) -> None:
        me = threading.get_native_id()
        before_cpu = threads_cpu()
        on0, wait0 = schedstat(me)
        faults0, switches0, machine0, vm0 = faults(me), switches(me), machine_cpu(), vmstat()
        t = time.perf_counter()
        result = step()  # type: ignore[operator]
        self.wall = time.perf_counter() - t
        self.batch = getattr(result, "batch_size", -1)  # Poisson: differs step to step
        on1, wait1 = schedstat(me)
        faults1 = faults(me)
        self.faults, self.system = faults1[0] - faults0[0], faults1[1] - faults0[1]
        self.preempted = switches(me) - switches0
        self.machine = {k: v - machine0[k] for k, v in machine_cpu().items()}
        self.vm = {k: v - vm0.get(k, 0) for k, v in vmstat().items()}
        after_cpu = threads_cpu()
        self.cpu, self.runnable = on1 - on0, wait1 - wait0
        self.asleep = max(0.0, self.wall - self.cpu - self.runnable)
        spent = {k: v - before_cpu.get(k, 0.0) for k, v in after_cpu.items() if k != me}
        # named after the step: the fsync pool's threads start with its first file
        writer_ids = {
            t.native_id
            for t in threading.enumerate()
            if writing and t.name.startswith(("ckpt", "state-fsync")) and t.native_id is not None
        }
        self.writer = sum(v for k, v in spent.items() if k in writer_ids)
        self.others = sum(v for k, v in spent.items() if k not in writer_ids)
        self.dirty, self.writeback = dirty_pages()

    def line(self) -> str:
        return (
            f"batch {self.batch:3d}, wall {self.wall * 1e3:5.0f} ms = CPU {self.cpu * 1e3:5.0f} + waiting for a core "
            f"{self.runnable * 1e3:4.0f} ({self.preempted} preemptions) + asleep "
            f"{self.asleep * 1e3:4.0f}; its system time {self.system * 1e3:.0f} ms, {self.faults} "
            f"faults; writer CPU {self.writer * 1e3:4.0f}, "
            f"other threads {self.others * 1e3:4.0f} ms; dirty {self.dirty / 2**20:.0f} MiB, "
            f"writeback {self.writeback / 2**20:.0f} MiB\n        machine CPU ms: "
            + ", ".join(f"{k} {v * 1e3:.0f}" for k, v in self.machine.items())
            + "\n        vmstat: "
            + ", ".join(f"{k} {v}" for k, v in self.vm.items())
        )


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__)
    p.add_argument("--dim", type=int, default=8_000_000, help="approximate model parameters")
    p.add_argument("--bands", type=int, default=8)
    p.add_argument("--every", type=int, default=4, help="steps between checkpoints (k)")
    p.add_argument("--pairs", type=int, default=6)
    p.add_argument("--dir", default=None, help="scratch folder (default: a temp dir)")
    p.add_argument(
        "--idle-writer",
        action="store_true",
        help="a third step in each pair: after a checkpoint whose writer thread is SCHED_IDLE",
    )
    p.add_argument(
        "--nice-writer",
        action="store_true",
        help="a step in each pair after a checkpoint whose writer thread runs at nice 10",
    )
    p.add_argument(
        "--paced-writer",
        action="store_true",
        help="a step in each pair after a checkpoint written through the page cache (paced) "
        "by a writer at nice 10",
    )
    p.add_argument(
        "--cadence",
        type=int,
        default=0,
        help="after the pairs: this many checkpoints every k steps per writer, twice, in turns",
    )
    p.add_argument(
        "--torch-threads", type=int, default=None, help="torch.set_num_threads (default: torch's)"
    )
    args = p.parse_args()
    if args.torch_threads is not None:
        import torch

        torch.set_num_threads(args.torch_threads)
    root = tempfile.mkdtemp(dir=args.dir)
    try:
        run(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run(args: argparse.Namespace, root: str) -> None:
    import torch

    print(
        f"load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; torch "
        f"threads {torch.get_num_threads()}"
    )
    cfg = JobConfig(
        job="example:mlp",
        dp=DPConfig(
            steps=10_000, batch_size=16, dataset_size=4096, noise_multiplier=1.0, bands=args.bands
        ),
        options={"hidden": max(1, args.dim // 25)},
    )
    trainer = build_trainer(cfg, bytes(32))
    for _ in range(args.bands + 1):  # the first steps' start-up is not the stall
        trainer.train_step()
    records: dict[str, object] = dict(job_records(cfg, trainer, bytes(32), None))
    records.setdefault("metrics", TrainingMetrics().to_record(0))
    modes = ["plain", "async"]
    checkpointers: dict[str, Checkpointer] = {}
    if args.idle_writer:
        modes.append("async-idle")
    if args.nice_writer:
        modes.append("async-nice10")
    if args.paced_writer:
        modes.append("async-paced")
    for mode in modes[1:]:
        store = Store.open(os.path.join(root, f"{mode}.zarr"))
        store.acquire_lease()
        checkpoint.BULK_IDLE = BULK_IDLE if mode == "async" else mode == "async-idle"
        checkpointers[mode] = ck = Checkpointer(store, async_write=True, keep_last=2)
        checkpoint.BULK_IDLE = BULK_IDLE
    ratios: dict[str, list[float]] = {m: [] for m in modes[1:]}
    cpu_ratios: dict[str, list[float]] = {m: [] for m in modes[1:]}
    samples: dict[str, list[Sample]] = {m: [] for m in modes}
    for i in range(args.pairs):
        got: dict[str, Sample] = {}
        # rotated every second pair and reversed in odd ones, so that no mode always
        # follows the same one: in plain rotations the mode listed after `plain` came
        # right after it in every pair but one, and either writer measured 1.08-1.42
        # there against 0.80-1.07 listed third (6 runs of 3 or 4 modes)
        r = (i // 2) % len(modes)
        turn = modes[r:] + modes[:r]
        if i % 2:
            turn.reverse()
        saved: dict[str, float] = {}
        size: int | None = None  # the pair's batch size, set by its first timed step
        for mode in turn:
            for _ in range(args.every - 1):  # the ring moves on as a job's would
                trainer.train_step()
            # Batches are Poisson (the sampler's, seeded): a pair's steps are timed at the
            # same batch size, more steps taken before the later ones until it comes up.
            # Without this the steps after a checkpoint drew 146 examples against 114 in
            # one run's 8 pairs, the same draws every run.
            for _ in range(_MATCH_STEPS):
                t_next = trainer.step_index
                if size is None or len(trainer.sampler.batch(t_next)) == size:
                    break
                trainer.train_step()
            size = len(trainer.sampler.batch(trainer.step_index))
            file_writes.DIRECT_BYTES = 0 if mode == "async-paced" else DIRECT
            if mode != "plain":
                t = time.perf_counter()
                checkpointers[mode].save(trainer, dict(records))
                saved[mode] = time.perf_counter() - t
            got[mode] = Sample(trainer.train_step, mode != "plain")
            if mode != "plain":
                checkpointers[mode].wait()  # the next step starts with no write in flight
            file_writes.DIRECT_BYTES = DIRECT
        for mode in modes[1:]:
            ratios[mode].append(got[mode].wall / got["plain"].wall)
            cpu_ratios[mode].append(got[mode].cpu / got["plain"].cpu)
        print(
            f"pair {i} ({', '.join(turn)}; load {os.getloadavg()[0]:.1f}): "
            + "; ".join(
                f"{m} ÷ plain {ratios[m][-1]:.2f} (training thread CPU {cpu_ratios[m][-1]:.2f}, "
                f"save() {saved[m] * 1e3:.0f} ms)"
                for m in modes[1:]
            )
        )
        for mode in modes:
            print(f"  {mode:<10} {got[mode].line()}")
            samples[mode].append(got[mode])
    if args.cadence:
        cadence(args, trainer, records, checkpointers)
    for ck in checkpointers.values():
        ck.close()
    for mode in modes[1:]:
        print(
            f"step after {mode} ÷ after none, median of {args.pairs} alternating pairs: wall "
            f"{statistics.median(ratios[mode]):.2f} (pairs "
            + ", ".join(f"{r:.2f}" for r in ratios[mode])
            + f"); the training thread's CPU {statistics.median(cpu_ratios[mode]):.2f}"
        )
    for mode, ss in samples.items():
        med = {
            k: statistics.median(getattr(s, k) for s in ss) * 1e3
            for k in ("wall", "cpu", "runnable", "asleep", "writer", "others")
        }
        print(
            f"median after {mode}: wall {med['wall']:.0f} ms = CPU {med['cpu']:.0f} + waiting "
            f"for a core {med['runnable']:.0f} + asleep {med['asleep']:.0f}; writer CPU "
            f"{med['writer']:.0f}, other threads {med['others']:.0f} ms; machine CPU ms: "
            + ", ".join(
                f"{k} {statistics.median(x.machine[k] for x in ss) * 1e3:.0f}" for k in _CPU_FIELDS
            )
        )
    print(f"load average at end: {os.getloadavg()[0]:.1f}")
    trainer.close()


def cadence(
    args: argparse.Namespace,
    trainer: object,
    records: dict[str, object],
    checkpointers: dict[str, Checkpointer],
) -> None:
    """A job's rhythm: per writer, in turns over 2 rounds, `--cadence` checkpoints every
    k steps with nothing waited for between them; how many `save()`s found the last
    version still in flight, and how long `save()` took (its wait for that version)."""
    found: dict[str, int] = dict.fromkeys(checkpointers, 0)
    waits: dict[str, list[float]] = {m: [] for m in checkpointers}
    steps: dict[str, list[float]] = {m: [] for m in checkpointers}
    names = list(checkpointers)
    for r in range(2):
        for mode in names[r % len(names) :] + names[: r % len(names)]:
            ck = checkpointers[mode]
            file_writes.DIRECT_BYTES = 0 if mode == "async-paced" else DIRECT
            for _ in range(args.cadence):
                for _ in range(args.every):
                    t = time.perf_counter()
                    trainer.train_step()  # type: ignore[attr-defined]
                    steps[mode].append(time.perf_counter() - t)
                found[mode] += ck.in_flight
                t = time.perf_counter()
                ck.save(trainer, dict(records))  # type: ignore[arg-type]
                waits[mode].append(time.perf_counter() - t)
            ck.wait()  # the next writer starts with nothing in flight (not counted)
            file_writes.DIRECT_BYTES = DIRECT
    for mode in names:
        print(
            f"cadence, {mode}: {found[mode]} of {len(waits[mode])} save()s found the last "
            f"version in flight; save() median {statistics.median(waits[mode]) * 1e3:.0f} ms, "
            f"max {max(waits[mode]) * 1e3:.0f} ms, sum {sum(waits[mode]):.2f} s; step median "
            f"{statistics.median(steps[mode]) * 1e3:.0f} ms over {len(steps[mode])} steps"
        )


if __name__ == "__main__":
    main()
