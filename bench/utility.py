"""Utility on real data: DP-SGD against BandMF (banded_sqrt and optimized) at the same
epsilon, steps and batch, beside what `cocoon_ckpt.dp.plan` predicts.

    python bench/utility.py [--datasets digits breast_cancer] [--eps 2 8] [--seeds 10]
                            [--quick] [--workers 1] [--results runs.jsonl]

Datasets ship with scikit-learn (bench/_utility_data.py: fixed train / validation / test
split, settings). For each dataset and epsilon (delta 1e-5) the plan calibrates sigma
per b and predicts each configuration's error; the bench trains DP-SGD (b = 1), BandMF
at each --bands with both mechanisms, and the plan's recommendation, through
`DPTrainer` (bench/_utility_train.py). The learning rate of every row, the non-private
ceiling's too, is chosen from one grid by mean validation accuracy over --val-seeds
seeds; then --seeds other seeds train at that rate and test accuracy is reported as
mean +- std, and as the mean +- std of the per-seed difference to DP-SGD (the seeds
are shared: same initial model). --results keeps every finished run (JSON lines) and
skips it when run again, so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import multiprocessing
import statistics
import sys
import time
from collections.abc import Iterable

from _utility_data import SETTINGS, load
from _utility_train import Run, train

from cocoon_ckpt.dp.plan import plan

DELTA = 1e-5
LR_GRID = (0.1, 0.3, 1.0, 3.0)
VAL_SEED0 = 1000  # validation runs use seeds 1000.., test runs 0..: never the same run


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Row:
    """One configuration of the table (a plan row, or the ceiling / Opacus)."""

    method: str
    epsilon: float | None
    bands: int
    mechanism: str | None
    sigma: float
    relative_error: float | None
    picked: bool = False
    kind: str = "dp"

    def run(self, dataset: str, steps: int, lr: float, seed: int) -> Run:
        return Run(
            dataset=dataset,
            steps=steps,
            kind=self.kind,
            epsilon=self.epsilon,
            bands=self.bands,
            mechanism=self.mechanism,
            sigma=self.sigma,
            lr=lr,
            seed=seed,
        )


class Results:
    """Finished runs by key, appended to a JSON-lines file when one is given."""

    def __init__(self, path: str | None, workers: int, partial: bool) -> None:
        self.path, self.workers, self.partial = path, workers, partial
        self.done: dict[str, dict[str, float]] = {}
        if path is not None:
            try:
                with open(path) as f:
                    for line in f:
                        r = json.loads(line)
                        self.done[r["key"]] = r
            except FileNotFoundError:
                pass

    def get(self, run: Run, what: str) -> float | None:
        """`what` ("val" or "test") accuracy of `run`; None when it has not run."""
        r = self.done.get(run.key())
        return None if r is None else float(r[what])

    def ensure(self, runs: Iterable[Run], what: str) -> None:
        todo = list({r.key(): r for r in runs if r.key() not in self.done}.values())
        if not todo or self.partial:
            return
        t0 = time.perf_counter()
        print(f"  {what}: {len(todo)} runs", file=sys.stderr, flush=True)
        if self.workers > 1:
            ctx = multiprocessing.get_context("spawn")
            with ctx.Pool(self.workers) as pool:
                self._collect(pool.imap_unordered(train, todo), len(todo), t0)
        else:
            self._collect(map(train, todo), len(todo), t0)

    def _collect(self, results: Iterable[dict[str, float | str]], total: int, t0: float) -> None:
        for i, r in enumerate(results, 1):
            self.done[str(r["key"])] = r  # type: ignore[assignment]
            if self.path is not None:
                with open(self.path, "a") as f:
                    f.write(json.dumps(r) + "\n")
            if i % 10 == 0 or i == total:
                took = time.perf_counter() - t0
                print(f"    {i}/{total} ({took:.0f} s)", file=sys.stderr, flush=True)


def rows_for(dataset: str, steps: int, eps: float, bands: list[int]) -> list[Row]:
    """DP-SGD, each of `bands` with both mechanisms, and the plan's pick, from one plan."""
    s = SETTINGS[dataset]
    p = plan(target_epsilon=eps, delta=DELTA, dataset_size=s.train, batch_size=s.batch, steps=steps)
    wanted = {1, *bands}
    rows = []
    for i, r in enumerate(p.rows):
        if r.bands in wanted or i == p.recommended:
            rows.append(
                Row(
                    method="DP-SGD" if r.bands == 1 else "BandMF",
                    epsilon=eps,
                    bands=r.bands,
                    mechanism=None if r.mechanism is None else r.mechanism.value,
                    sigma=r.noise_multiplier,
                    relative_error=r.relative_error,
                    picked=i == p.recommended,
                )
            )
    return rows


def choose_lr(
    res: Results, row: Row, dataset: str, steps: int, val_seeds: list[int], grid: list[float]
) -> float | None:
    """The grid's rate of best mean validation accuracy (ties: the smaller rate); under
    --partial over the runs finished, None when there are none."""
    scores = {}
    for lr in grid:
        got = [res.get(row.run(dataset, steps, lr, v), "val") for v in val_seeds]
        if any(a is not None for a in got):
            scores[lr] = statistics.fmean(a for a in got if a is not None)
    return max(scores, key=lambda lr: scores[lr]) if scores else None


def _mean_std(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0


def _pct(mean: float, std: float, sign: bool = False) -> str:
    return f"{100 * mean:{'+' if sign else ''}.2f} ± {100 * std:.2f}"


def _opacus() -> bool:
    try:
        import opacus  # noqa: F401
    except ImportError:
        return False
    return True


def bench_dataset(
    dataset: str, steps: int, eps_list: list[float], args: argparse.Namespace, res: Results
) -> None:
    s = SETTINGS[dataset]
    split = load(dataset)
    rows: list[Row] = []
    for eps in eps_list:
        rows += rows_for(dataset, steps, eps, args.bands)
    ceiling = Row(
        method="non-private",
        epsilon=None,
        bands=1,
        mechanism=None,
        sigma=0.0,
        relative_error=None,
        kind="plain",
    )
    val_seeds = [VAL_SEED0 + i for i in range(args.val_seeds)]
    seeds = list(range(args.seeds))
    every = [ceiling, *rows]
    lrs: dict[Row, float | None] = {}
    # Row by row, those the verdict reads first, so an interrupted run leaves whole rows.
    for r in sorted(every, key=lambda r: _priority(r, min(eps_list))):
        res.ensure(
            (r.run(dataset, steps, lr, v) for lr in args.lrs for v in val_seeds),
            f"{dataset}: {_name(r)}: learning-rate grid",
        )
        lrs[r] = lr = choose_lr(res, r, dataset, steps, val_seeds, args.lrs)
        res.ensure(
            (r.run(dataset, steps, lr, seed) for seed in seeds if lr is not None),
            f"{dataset}: {_name(r)}: {len(seeds)} seeds at lr {lr}",
        )
    every = [r for r in every if lrs[r] is not None]  # under --partial: rows not yet run
    rows = [r for r in rows if lrs[r] is not None]
    if _opacus():
        for sgd in [r for r in rows if r.bands == 1]:
            ref = dataclasses.replace(sgd, method="Opacus DP-SGD", picked=False, kind="opacus")
            lrs[ref] = lr = lrs[sgd]  # the reference at our DP-SGD's sigma and rate
            every.append(ref)
            res.ensure(
                (ref.run(dataset, steps, lr, seed) for seed in seeds if lr is not None),
                f"{dataset}: {_name(ref)}: {len(seeds)} seeds",
            )
        opacus_note = "Opacus DP-SGD: our DP-SGD row's sigma and learning rate, its own sampler"
    else:
        opacus_note = "opacus not installed: no Opacus reference row"

    def tests(r: Row) -> dict[int, float]:
        lr = lrs[r]
        got = (
            {seed: res.get(r.run(dataset, steps, lr, seed), "test") for seed in seeds} if lr else {}
        )
        return {seed: a for seed, a in got.items() if a is not None}

    print(
        f"\n### {dataset}: N={s.train} train / {len(split.y_val)} validation / "
        f"{len(split.y_test)} test, batch {s.batch}, {steps} steps, delta {DELTA:g}, clip 1, "
        f"plain SGD, MLP {split.features}-{s.hidden}-{split.classes} (tanh)\n"
        f"learning rate from {args.lrs} by mean validation accuracy over "
        f"{len(val_seeds)} seeds; test accuracy over {len(seeds)} seeds (mean ± std, %); "
        f"'vs DP-SGD' is the per-seed difference (same seeds, same initial models); "
        f"* the plan's recommendation; {opacus_note}"
        + ("; PARTIAL: rates from the finished validation runs\n" if res.partial else "\n")
    )
    print(
        "| method | b | mechanism | epsilon | sigma | lr | plan: error vs DP-SGD "
        "| test accuracy % | vs DP-SGD (points) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    diffs: dict[Row, tuple[float, float, int]] = {}
    for r in every:
        acc = tests(r)
        base = next((x for x in rows if x.epsilon == r.epsilon and x.bands == 1), None)
        diff = "-"
        if base is not None and r.kind == "dp" and r is not base:
            ref = tests(base)
            d = [a - ref[seed] for seed, a in acc.items() if seed in ref]  # same seeds
            if d:
                diffs[r] = (*_mean_std(d), len(d))
                diff = _pct(*diffs[r][:2], sign=True) + _count(len(d), len(seeds))
        plain = r.kind == "plain"
        edge = " (edge)" if lrs[r] in (min(args.lrs), max(args.lrs)) else ""
        shown = _pct(*_mean_std(list(acc.values()))) + _count(len(acc), len(seeds)) if acc else "-"
        print(
            f"| {r.method}{' *' if r.picked else ''} | {'-' if plain else r.bands} "
            f"| {r.mechanism or '-'} | {'∞' if plain else f'{r.epsilon:g}'} "
            f"| {'-' if plain else f'{r.sigma:.4f}'} "
            f"| {lrs[r]:g}{edge} "
            f"| {'-' if r.relative_error is None else f'{r.relative_error:.3f}'} "
            f"| {shown} | {diff} |"
        )
    print("\n" + verdict(dataset, rows, diffs))


def _priority(r: Row, lowest: float) -> tuple[int, int, float]:
    """The ceiling (cheap), then DP-SGD and the plan's picks, then b > 1 at the lowest
    epsilon (the second verdict reads them all), then the rest; higher epsilon first."""
    if r.kind == "plain":
        return (0, 0, 0.0)
    rank = 0 if r.bands == 1 or r.picked else 1 if r.epsilon == lowest else 2
    return (1, rank, -(r.epsilon or 0.0))


def _name(r: Row) -> str:
    b = "" if r.bands == 1 else f" b={r.bands} {r.mechanism}"
    return f"{r.method}{b}" + ("" if r.epsilon is None else f" eps={r.epsilon:g}")


def _count(k: int, of: int) -> str:
    return "" if k == of else f" ({k} of {of} seeds)"


def _sig(mean: float, std: float, n: int) -> str:
    se = std / math.sqrt(n)
    word = "clearly" if abs(mean) > 2 * se else "not clearly (within 2 standard errors)"
    return f"{100 * mean:+.2f} ± {100 * se:.2f} points (standard error), {word}"


def verdict(dataset: str, rows: list[Row], diffs: dict[Row, tuple[float, float, int]]) -> str:
    """The plan's picks against the bench's numbers, at the highest and lowest epsilon."""
    eps = sorted({r.epsilon for r in rows if r.epsilon is not None})
    if not eps:
        return f"Verdict ({dataset}): no private run has finished yet."
    parts = [f"Verdict ({dataset}):"]
    hi, lo = eps[-1], eps[0]
    pick = next((r for r in rows if r.epsilon == hi and r.picked), None)
    if pick is None or (pick.bands > 1 and pick not in diffs):
        parts.append(f"at epsilon {hi:g} the plan's pick has not run yet.")
    elif pick.bands == 1:
        parts.append(f"at epsilon {hi:g} the plan recommends DP-SGD itself.")
    else:
        m, sd, n = diffs[pick]
        verb = "beats" if m > 0 else "does not beat"
        parts.append(
            f"at epsilon {hi:g} the plan's pick (b={pick.bands}, {pick.mechanism}, predicted "
            f"{pick.relative_error:.3f}x DP-SGD's error) {verb} DP-SGD: {_sig(m, sd, n)}."
        )
    pick = next((r for r in rows if r.epsilon == lo and r.picked), None)
    banded = [r for r in rows if r.epsilon == lo and r.bands > 1 and r in diffs]
    if lo == hi or pick is None or not banded:
        return " ".join(parts)
    lose = all(diffs[r][0] < 0 for r in banded)
    shown = "; ".join(f"b={r.bands} {r.mechanism} {100 * diffs[r][0]:+.2f}" for r in banded)
    if lose:
        bench = f"the bench shows every b > 1 losing to DP-SGD ({shown} points)"
    else:
        bench = f"the bench does not show every b > 1 losing ({shown} points)"
    if pick.bands == 1:
        plans = "the plan avoids b > 1 (it recommends DP-SGD)"
    elif pick in diffs:
        m, sd, n = diffs[pick]
        plans = (
            f"the plan recommends b={pick.bands} {pick.mechanism} (predicted "
            f"{pick.relative_error:.3f}x), which against DP-SGD is {_sig(m, sd, n)}"
        )
    else:
        plans = f"the plan recommends b={pick.bands} {pick.mechanism} (not run yet)"
    if lose and pick.bands > 1:
        agree = "so the plan does NOT avoid b > 1 where the bench shows it loses"
    elif lose:
        agree = "so plan and bench agree"
    else:
        agree = "so there is no loss for the plan to avoid"
    parts.append(f"At epsilon {lo:g} {bench}; {plans}; {agree}.")
    return " ".join(parts)


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--datasets", nargs="+", choices=sorted(SETTINGS), default=None)
    p.add_argument("--eps", nargs="+", type=float, default=[2.0, 8.0])
    p.add_argument("--bands", nargs="+", type=int, default=[4], help="b > 1 run beside the pick")
    p.add_argument(
        "--lrs", nargs="+", type=float, default=list(LR_GRID), help="the one learning-rate grid"
    )
    p.add_argument("--seeds", type=int, default=None, help="test seeds per row (10)")
    p.add_argument("--val-seeds", type=int, default=None, help="seeds per learning rate (2)")
    p.add_argument("--steps", type=int, default=None, help="override each dataset's steps")
    p.add_argument("--workers", type=int, default=1, help="processes (2 on an idle machine)")
    p.add_argument("--results", default=None, help="JSON-lines file of finished runs")
    p.add_argument(
        "--partial", action="store_true", help="run nothing: the tables of --results so far"
    )
    p.add_argument(
        "--quick", action="store_true", help="smoke run: digits, fewer steps, 2 seeds, 1 val seed"
    )
    args = p.parse_args()
    # --quick changes only what is not given: one dataset, 2 seeds, 1 validation seed
    quick = args.quick
    args.datasets = args.datasets or (["digits"] if quick else list(SETTINGS))
    args.seeds = args.seeds or (2 if quick else 10)
    args.val_seeds = args.val_seeds or (1 if quick else 2)
    res = Results(args.results, args.workers, args.partial)
    for dataset in args.datasets:
        s = SETTINGS[dataset]
        steps = args.steps or (s.quick_steps if args.quick else s.steps)
        bench_dataset(dataset, steps, sorted(args.eps), args, res)


if __name__ == "__main__":
    main()
