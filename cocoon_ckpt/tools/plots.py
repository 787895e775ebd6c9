"""PNG plots of a store (matplotlib, headless): what `audit --plot DIR` writes."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from cocoon_ckpt.dp.accountant import epsilon as compute_epsilon
from cocoon_ckpt.dp.mechanism import BandMF
from cocoon_ckpt.errors import MissingExtraError
from cocoon_ckpt.layout import array_kind
from cocoon_ckpt.tools.catalog import placement
from state import CorruptVersionError, Manifest, Store, Version
from state.paths import version_prefix

__all__ = ["require_matplotlib", "write_plots"]

#: The install command named when matplotlib is missing (it is an optional extra).
PLOTS_EXTRA = "pip install 'cocoon-ckpt[plots]'"


def require_matplotlib() -> None:
    """Import matplotlib and select its headless backend (Agg).

    Raises:
        MissingExtraError: matplotlib cannot be imported; the message names the extra.
    """
    try:
        import matplotlib
    except ImportError as exc:
        raise MissingExtraError(
            f"PNG plots (audit --plot) need matplotlib, which cannot be imported ({exc}); "
            f"install the plots extra: {PLOTS_EXTRA}"
        ) from exc
    matplotlib.use("Agg")


def _inverse_row_norms(coefficients: np.ndarray, horizon: int) -> np.ndarray:
    """||row t of C^-1|| for t < horizon, in O(horizon b) time and O(horizon) memory.

    C is lower-triangular banded Toeplitz, so C^-1 is lower-triangular Toeplitz with
    first column u (forward substitution of C u = e_0); row t is u_t, ..., u_0.
    """
    c = np.asarray(coefficients, dtype=np.float64)
    u = np.zeros(horizon)
    for t in range(horizon):
        acc = 1.0 if t == 0 else 0.0
        for j in range(1, min(len(c), t + 1)):
            acc -= c[j] * u[t - j]
        u[t] = acc / c[0]
    return np.sqrt(np.cumsum(u**2))


def write_plots(
    store: Store,
    manifests: dict[int, Manifest],
    out_dir: str,
    *,
    skip_paths: set[str] | frozenset[str] = frozenset(),
) -> list[str]:
    """Write epsilon.png, noise_norm.png, history_tiers.png and checkpoint_sizes.png.

    Args:
        store: the open store.
        manifests: its readable manifests by version, whose records are within the
            config's bounds (`cocoon_ckpt.tools.bounds`).
        out_dir: created if missing.
        skip_paths: array paths never to read (out of bounds).

    Returns:
        The paths written.

    Raises:
        MissingExtraError: matplotlib is not installed (nothing is written).
    """
    require_matplotlib()
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    newest = manifests[max(manifests)]
    rec = newest.records
    dp = rec["config"]["dp"]
    paths: list[str] = []

    def save(fig: Any, name: str) -> None:
        p = os.path.join(out_dir, name)
        fig.tight_layout()
        fig.savefig(p, dpi=100)
        plt.close(fig)
        paths.append(p)

    # 1. epsilon over steps: recomputed at every participation round, stored at versions.
    n, b = int(dp["steps"]), int(dp["bands"])
    steps = sorted({min(s, n) for s in range(b, n + b, b)} | {1})
    eps = [
        compute_epsilon(
            dp["noise_multiplier"], dp["dataset_size"], dp["batch_size"], s, b, dp["delta"]
        )
        for s in steps
    ]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.step(steps, eps, where="post", label="recomputed from the config")
    vs = sorted(manifests.values(), key=lambda m: m.version)
    ax.plot(
        [m.step for m in vs if m.step > 0],
        [m.records["accountant"]["epsilon"] for m in vs if m.step > 0],
        "o",
        label="stored in versions",
    )
    ax.set(xlabel="step", ylabel=f"epsilon at delta={dp['delta']:g}", title="privacy spent")
    ax.legend()
    save(fig, "epsilon.png")

    # 2. noise norm per step: stored ring slots against the expected norm of w_t.
    seen: dict[int, float] = {}
    for m in vs:
        ver = Version(store, m)
        for shard in m.records["noise"]["shards"]:
            for _slot, step, name in shard["slots"]:
                if m.arrays[name].path in skip_paths:
                    continue
                try:
                    seen[int(step)] = float(np.linalg.norm(ver.array(name).astype(np.float64)))
                except (CorruptVersionError, KeyError):
                    continue
    fig, ax = plt.subplots(figsize=(6, 3.5))
    dim = int(rec["noise"]["dim"])
    std = float(dp["noise_multiplier"]) * float(dp["max_grad_norm"])
    mech = BandMF.from_state_dict(rec["mechanism"])
    horizon = max([*seen, newest.step - 1, 0]) + 1
    expected = std * np.sqrt(dim) * _inverse_row_norms(mech.coefficients, horizon)
    ax.plot(range(horizon), expected, "-", label="expected ||w_t|| (std sqrt(m) ||C^-1 row||)")
    if seen:
        ks = sorted(seen)
        ax.plot(ks, [seen[k] for k in ks], "o", label="stored ring slots")
    ax.set(xlabel="step", ylabel="||w_t||_2", title="correlated noise norm")
    ax.legend()
    save(fig, "noise_norm.png")

    # 3. history bytes per tier, per version.
    tiers: dict[str, list[int]] = {}
    for i, m in enumerate(vs):
        nrec = m.records["noise"]
        item = np.dtype(nrec["dtype"]).itemsize
        for shard in placement(nrec):
            row = tiers.setdefault(shard["tier"], [0] * len(vs))
            row[i] += (int(shard["stop"]) - int(shard["start"])) * (b - 1) * item
    fig, ax = plt.subplots(figsize=(6, 3.5))
    bottom = np.zeros(len(vs))
    labels = [str(m.version) for m in vs]
    for tier, row in sorted(tiers.items()):
        ax.bar(labels, row, bottom=bottom, label=tier)
        bottom += np.asarray(row, dtype=float)
    ax.set(xlabel="version", ylabel="bytes", title="noise history bytes per tier")
    ax.legend()
    save(fig, "history_tiers.png")

    # 4. checkpoint sizes per version: bytes each version wrote, by kind.
    kinds: dict[str, list[int]] = {}
    for i, m in enumerate(vs):
        own = version_prefix(m.version)
        for name, meta in m.arrays.items():
            if meta.path.startswith(own):
                kinds.setdefault(array_kind(name), [0] * len(vs))[i] += meta.nbytes
    fig, ax = plt.subplots(figsize=(6, 3.5))
    bottom = np.zeros(len(vs))
    for kind, row in sorted(kinds.items()):
        ax.bar(labels, row, bottom=bottom, label=kind)
        bottom += np.asarray(row, dtype=float)
    total = [sum(meta.nbytes for meta in m.arrays.values()) for m in vs]
    ax.plot(labels, total, "k.--", label="referenced in all")
    ax.set(xlabel="version", ylabel="bytes", title="checkpoint bytes written per version")
    ax.legend()
    save(fig, "checkpoint_sizes.png")
    return paths
