"""Where a checkpoint's stall and the first step's extra time go, as same-run ratios.

    python bench/stall.py [--dim 8000000] [--bands 8] [--every 4] [--rounds 4]

One trainer (the mlp example at ~`--dim` parameters), steps timed one by one:
- first: the first step of a fresh trainer against the median steady step, and where
  each spends its time (the clipped sum, the fresh noise, the ring's GEMV and write, the
  noisy gradients, the optimizer; "rest" is the step's own bookkeeping), and the build
  and first step together in steady steps (the build waits for the kernels' warm-up);
- per round, in an order that alternates round by round, the step right after
  - `plain`: nothing,
  - `snap`: a snapshot taken and dropped (its copies into fresh memory, no write),
  - `async`: an asynchronous checkpoint (snapshot, then the write in the background),
  - `async-nice0`: the same with the writer thread at nice 0 (what a version below
    `BULK_BYTES` gets; the lowered writer is what lowering buys);
  - `async-crc`: `async` with the lent ring rows' checksums taken on the training
    thread, as before they were left to the writer (`SharedRows.defer_checksum`);
  each against `plain` (wall, and the training thread's own CPU time: the rest of a
  stall is the writer and the machine's load taking the cores), with the snapshot's own
  time on the training thread: `save()`, its CPU time, and its model copy and noise
  part (the ring rows' entries) inside it.
Every ratio is a median over `--rounds` rounds of this run. Prints the machine's load.

    python bench/stall.py --gpt --depth 8 --d 512 --bands 4 --physical 8 [--no-fault-in]

The first step alone on bench/scale.py's GPT-shaped transformer (25.8M parameters at
depth 8, d 512; ghost clipping, logical batch 8): its first step against the median of
`--bands + 1` steady ones, by phase. `--no-fault-in` leaves the kept gradient buffer's
pages to the first step (`train.warm.fault_in` off), the same-machine comparison; run
the two alternately, one process each (a first step is once a process).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

from cocoon_ckpt import DPConfig, JobConfig
from cocoon_ckpt.format.metrics import TrainingMetrics
from cocoon_ckpt.train.checkpoint import Checkpointer, take_snapshot
from cocoon_ckpt.train.job_records import job_records
from cocoon_ckpt.train.runner import build_trainer
from state import Store


def timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _timed_into(owner: Any, fn: Callable[..., Any], label: str) -> Callable[..., Any]:
    """`fn`, its seconds added into `owner.spent[label]` at each call while `owner.on`
    (an owner without `on` always counts)."""

    def timed_call(*a: Any, **kw: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            if getattr(owner, "on", True):
                owner.spent[label] = owner.spent.get(label, 0.0) + time.perf_counter() - t

    return timed_call


class PhaseClock:
    """Seconds per phase of the steps taken while `on`: the trainer's parts are wrapped
    (instance attributes shadow their methods; nothing they compute changes)."""

    PHASES = (
        ("_clipped", "clipped sum"),
        ("noise.fresh_noise.fresh", "fresh noise"),
        ("noise.history.gemv", "ring GEMV"),
        ("noise.history.write", "ring write"),
        ("_noisy.set", "noisy grads"),
        ("optimizer.step", "optimizer"),
    )

    def __init__(self, trainer: Any) -> None:
        self.on = False
        self.spent: dict[str, float] = {}
        for path, label in self.PHASES:
            *owner_path, name = path.split(".")
            owner = trainer
            for part in owner_path:
                owner = getattr(owner, part, None)
            if owner is not None and hasattr(owner, name):
                setattr(owner, name, _timed_into(self, getattr(owner, name), label))

    def step(self, trainer: Any) -> tuple[float, dict[str, float]]:
        """One step: its seconds and its seconds per phase ("rest": the remainder)."""
        self.spent, self.on = {}, True
        total = timed(trainer.train_step)
        self.on = False
        spent = dict(self.spent)
        spent["rest"] = total - sum(spent.values())
        return total, spent


class SaveParts:
    """Seconds of `save()` in the model's copy and the noise part (the new ring rows'
    entries), by wrapping the codec's part encoders; `defer` False takes the lent rows'
    checksums on the training thread (as before the writer took them)."""

    LABELS = ("model copy", "noise part")

    def __init__(self) -> None:
        from cocoon_ckpt.format import codec
        from cocoon_ckpt.format.parts import noise as noise_part

        self.spent: dict[str, float] = {}
        self.defer = True
        for mod, label in ((codec.model, "model copy"), (codec.noise, "noise part")):
            mod.encode = _timed_into(self, mod.encode, label)  # type: ignore[method-assign]
        deferred = noise_part.defer_row_checksum
        noise_part.defer_row_checksum = lambda view, entry: (  # type: ignore[assignment]
            self.defer and deferred(view, entry)
        )


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__)
    p.add_argument("--dim", type=int, default=8_000_000, help="approximate model parameters")
    p.add_argument("--bands", type=int, default=8)
    p.add_argument("--every", type=int, default=4, help="steps between checkpoints (k)")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--dir", default=None, help="scratch folder (default: a temp dir)")
    p.add_argument("--first-only", action="store_true", help="the first step, no checkpoints")
    p.add_argument(
        "--join-warm-up",
        action="store_true",
        help="wait for the warm-up threads before the first step (a job's start-up between "
        "the trainer's build and step 0: the store, the lease, the first version)",
    )
    p.add_argument("--gpt", action="store_true", help="the first step of bench/scale.py's GPT")
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--d", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--physical", type=int, default=8)
    p.add_argument("--clipping", default="ghost", choices=["ghost", "vmap"])
    p.add_argument(
        "--no-fault-in", action="store_true", help="the kept buffers' pages left to the first step"
    )
    args = p.parse_args()
    if args.no_fault_in:
        from cocoon_ckpt.train import noisy_grads

        noisy_grads.fault_in = lambda buffers: None  # type: ignore[assignment]
    if args.join_warm_up:
        from cocoon_ckpt.train import trainer as trainer_module

        global WARM_UP
        WARM_UP = threads = []
        start = trainer_module.warm_kernels

        def kept(*a: Any, **kw: Any) -> Any:
            t = start(*a, **kw)
            threads.extend([t] if t is not None else [])
            return t

        trainer_module.warm_kernels = kept  # type: ignore[assignment]
    if args.gpt:
        first_step_gpt(args)
        return
    root = tempfile.mkdtemp(dir=args.dir)
    try:
        run(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


#: the warm-up threads a trainer started, waited for before its first step (None: not)
WARM_UP: list[Any] | None = None


def first_and_steady(trainer: Any, built: float, steps: int) -> None:
    """Time the first step of `trainer` and `steps` steady ones, by phase, and print them
    (after the warm-up threads, waited for and timed, with `--join-warm-up`)."""
    if WARM_UP is not None:
        for t in [*WARM_UP, trainer._noisy.faulting]:
            waited = timed(t.join) if t is not None else 0.0
            print(f"waited {waited * 1e3:.0f} ms for {t.name if t is not None else '-'}")
    clock = PhaseClock(trainer)
    first, first_phases = clock.step(trainer)
    runs = [clock.step(trainer) for _ in range(steps)]
    steady = [s for s, _ in runs]
    print(
        f"dim {trainer.dim}: build {built * 1e3:.0f} ms, first step {first * 1e3:.0f} ms, steady "
        f"{statistics.median(steady) * 1e3:.0f} ms, ratio {first / statistics.median(steady):.2f}"
    )
    # what start-up costs in all, so a wait moved into the build is not hidden
    print(f"  build + first step = {(built + first) / statistics.median(steady):.2f} steady steps")
    for label in first_phases:
        mid = statistics.median(p.get(label, 0.0) for _, p in runs)
        print(
            f"  {label:<12} first {first_phases[label] * 1e3:7.0f} ms, steady {mid * 1e3:7.0f} ms"
        )


def first_step_gpt(args: argparse.Namespace) -> None:
    """The first step of bench/scale.py's transformer in `DPTrainer` against steady ones."""
    import scale  # bench/ is on sys.path: this file runs as a script from there
    import torch

    from cocoon_ckpt.train.data import Batch
    from cocoon_ckpt.train.trainer import DPTrainer

    print(f"load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    spec = dict(depth=args.depth, d=args.d, heads=args.heads, vocab=1024, seq=32, classes=16)
    spec["batch"] = 8
    model, x, y = scale.make(spec)
    torch.set_num_threads(1)  # as bench/scale.py's contenders
    cfg = DPConfig(
        steps=10_000,
        batch_size=8,
        dataset_size=int(x.shape[0]),
        noise_multiplier=1.0,
        bands=args.bands,
        physical_batch_size=args.physical,
        clipping=args.clipping,
    )
    built = time.perf_counter()
    trainer = DPTrainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.01),
        torch.nn.functional.cross_entropy,
        (x, y),
        cfg,
        bytes(32),
    )
    built = time.perf_counter() - built
    draw = trainer.train_step

    def step() -> object:  # the same 8 examples every step, as bench/scale.py's
        i = trainer.step_index % 64
        idx = torch.arange(i * 8, i * 8 + 8)
        return draw(Batch(trainer.step_index, idx, (x[idx], y[idx]), 8))

    trainer.train_step = step  # type: ignore[method-assign]
    first_and_steady(trainer, built, args.bands + 1)
    print(f"load average at end: {os.getloadavg()[0]:.1f}")
    trainer.close()


def run(args: argparse.Namespace, root: str) -> None:
    print(f"load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    cfg = JobConfig(
        job="example:mlp",
        dp=DPConfig(
            steps=10_000, batch_size=16, dataset_size=4096, noise_multiplier=1.0, bands=args.bands
        ),
        options={"hidden": max(1, args.dim // 25)},
    )
    built = time.perf_counter()
    trainer = build_trainer(cfg, bytes(32))
    built = time.perf_counter() - built
    first_and_steady(trainer, built, args.bands + 1)
    if args.first_only:
        trainer.close()
        return
    records: dict[str, object] = dict(job_records(cfg, trainer, bytes(32), None))
    records.setdefault("metrics", TrainingMetrics().to_record(0))
    stores = {}
    checkpointed = ("async", "async-nice0", "async-crc")
    for mode in checkpointed:
        store = Store.open(os.path.join(root, f"{mode}.zarr"))
        store.acquire_lease()
        ck = Checkpointer(store, async_write=True, keep_last=2)
        if mode == "async-nice0":
            ck._bulk = ck._pool  # every version to the writer at nice 0
        stores[mode] = ck
    modes = ["plain", "snap", *checkpointed]
    parts = SaveParts()
    after: dict[str, list[float]] = {m: [] for m in modes}
    # the training thread's own CPU seconds in that step: what it does, not what the
    # writer and the machine's other load take from it
    own: dict[str, list[float]] = {m: [] for m in modes}
    snap_t: list[float] = []
    write_t: dict[str, list[float]] = {m: [] for m in checkpointed}
    save_t: dict[str, list[float]] = {m: [] for m in checkpointed}  # training thread
    save_cpu: dict[str, list[float]] = {m: [] for m in checkpointed}
    save_parts: dict[str, list[dict[str, float]]] = {m: [] for m in checkpointed}
    for r in range(args.rounds):
        for mode in modes if r % 2 == 0 else modes[::-1]:
            for _ in range(args.every - 1):  # the ring moves on as a job's would
                trainer.train_step()
            if mode == "snap":
                parent = stores["async"].last  # the copies an async checkpoint makes
                snap_t.append(timed(lambda p=parent: take_snapshot(trainer, p, {})))  # type: ignore[misc]
            elif mode != "plain":
                ck = stores[mode]
                parts.spent = {}
                parts.defer = mode != "async-crc"
                t0, c0 = time.perf_counter(), time.thread_time()
                ck.save(trainer, dict(records))
                save_t[mode].append(time.perf_counter() - t0)
                save_cpu[mode].append(time.thread_time() - c0)
                save_parts[mode].append(dict(parts.spent))
            c = time.thread_time()
            after[mode].append(timed(trainer.train_step))
            own[mode].append(time.thread_time() - c)
            if mode.startswith("async"):
                stores[mode].wait()
                write_t[mode].append(time.perf_counter() - t0)
    for ck in stores.values():
        ck.close()
    base = statistics.median(after["plain"])
    print(f"step after nothing: {base * 1e3:.0f} ms (median of {args.rounds})")
    for mode in modes[1:]:
        m = statistics.median(after[mode])
        mine = statistics.median(own[mode]) / statistics.median(own["plain"])
        print(
            f"step after {mode}: {m * 1e3:.0f} ms, ratio {m / base:.2f}; the training "
            f"thread's CPU time ratio {mine:.2f}"
        )
    print(f"dropped snapshot (fresh buffers): {statistics.median(snap_t) * 1e3:.0f} ms")
    for mode, ts in write_t.items():
        split = ", ".join(
            f"{k} {statistics.median(p.get(k, 0.0) for p in save_parts[mode]) * 1e3:.0f} ms"
            for k in SaveParts.LABELS
        )
        print(
            f"{mode}: save() on the training thread {statistics.median(save_t[mode]) * 1e3:.0f} ms"
            f" (CPU {statistics.median(save_cpu[mode]) * 1e3:.0f} ms; {split}), save to "
            f"committed {statistics.median(ts) * 1e3:.0f} ms"
        )
    print(f"load average at end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
