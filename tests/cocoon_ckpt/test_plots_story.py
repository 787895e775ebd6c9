"""The plots tell the story: the epsilon curve's point at step k is epsilon after k
steps (not one participation round late), the loss and the loop's metrics are drawn
on the same steps, noise is drawn against the clipped-gradient signal, every axis of a
quantity starts at zero, and a one-tier job gets no single-colour bar chart."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cocoon_ckpt import open_job
from cocoon_ckpt.dp.accounting.amplified import epsilon
from cocoon_ckpt.examples import mlp as mlp_job
from cocoon_ckpt.tools.plots import epsilon_curve, write_plots
from cocoon_ckpt.train.options import JobOptions
from state import Store

from .conftest import job_config


@pytest.mark.parametrize(("bands", "steps"), [(4, 24), (5, 18), (8, 18), (1, 5)])
def test_the_epsilon_curve_at_step_k_is_epsilon_after_k_steps(bands: int, steps: int) -> None:
    dp = job_config("mlp", bands=bands, steps=steps).to_record()["dp"]
    curve = epsilon_curve(dp)
    assert curve.at(0) == 0.0 and curve.steps[-1] == steps
    for k in range(1, steps + 1):
        want = epsilon(
            dp["noise_multiplier"],
            dp["dataset_size"],
            dp["batch_size"],
            k,
            bands,
            dp["delta"],
            "pld",
        )
        assert curve.at(k) == want, k
    with pytest.raises(ValueError, match=f"step {steps + 1} is outside"):
        curve.at(steps + 1)


@pytest.fixture(scope="module")
def figures(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The figures `write_plots` saves for a one-tier job whose loop logs accuracy,
    captured as they are saved (matplotlib is in the test extra: no skip)."""
    import matplotlib.figure

    root = tmp_path_factory.mktemp("plots")
    cfg = job_config("mlp", bands=4, steps=12)
    url = str(root / "s.zarr")
    with open_job(
        cfg, url, mlp_job.build(cfg), options=JobOptions(key_file=str(root / "k"))
    ) as job:
        for res in job.steps():
            if res.step % 4 == 3:
                job.log(accuracy=0.5 + res.step / 100)
    store = Store.open(url, create=False)
    manifests = {v: store.manifest(v) for v in store.versions()}
    saved: dict[str, Any] = {}
    original = matplotlib.figure.Figure.savefig

    def capture(fig: Any, path: Any, *args: Any, **kw: Any) -> None:
        saved[Path(path).name] = fig
        original(fig, path, *args, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(matplotlib.figure.Figure, "savefig", capture)
        paths = write_plots(store, manifests, str(root / "out"))
    assert sorted(Path(p).name for p in paths) == sorted(saved)
    assert all(Path(p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths)
    return {"figures": saved, "dp": cfg.to_record()["dp"]}


def test_every_axis_of_a_quantity_starts_at_zero(figures: dict[str, Any]) -> None:
    figs = figures["figures"]
    assert sorted(figs) == [
        "checkpoint_sizes.png",
        "epsilon.png",
        "history_tiers.png",
        "noise_norm.png",
    ]
    for name, fig in figs.items():
        for ax in fig.axes:
            assert ax.get_ylim()[0] == 0, (name, ax.get_ylabel())
            if name != "checkpoint_sizes.png":  # versions are categories there
                assert ax.get_xlim()[0] == 0, (name, ax.get_ylabel())


def test_epsilon_is_drawn_above_the_loss_and_the_logged_metrics(figures: dict[str, Any]) -> None:
    eps, loss, acc = figures["figures"]["epsilon.png"].axes
    assert eps.get_ylabel().startswith("epsilon") and loss.get_ylabel() == "loss"
    assert acc.get_ylabel() == "accuracy"
    curve = epsilon_curve(figures["dp"])
    assert list(eps.lines[0].get_xdata()) == curve.steps
    assert list(eps.lines[0].get_ydata()) == curve.epsilons
    assert list(loss.lines[0].get_xdata()) == list(range(12))
    assert list(acc.lines[0].get_xdata()) == [3, 7, 11]


def test_noise_is_drawn_against_the_clipped_gradient_signal(figures: dict[str, Any]) -> None:
    (ax,) = figures["figures"]["noise_norm.png"].axes
    dp = figures["dp"]
    labels = [line.get_label() for line in ax.lines]
    signal = ax.lines[labels.index("largest clipped-gradient sum (B x C)")]
    assert set(signal.get_ydata()) == {dp["batch_size"] * dp["max_grad_norm"]}
    assert "stored ring slots" in labels and "noise against signal" in ax.get_title()


def test_a_one_tier_job_gets_no_single_colour_bars(figures: dict[str, Any]) -> None:
    (ax,) = figures["figures"]["history_tiers.png"].axes
    assert not ax.containers  # no bars
    assert ax.lines and "all on host" in ax.get_title()
