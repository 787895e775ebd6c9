"""plan: sigma calibrated per b, the predicted error, and the pick.

The shared setting (N=380, B=20, n=150) is the digits run (N=1200, B=20, n=1500) made
ten times shorter at the same DP-SGD sigma at epsilon 2 (q sqrt(n) about equal): there
the digits result shows too, more bands pay at epsilon 8 and not at epsilon 2.
"""

from __future__ import annotations

import json
import math

import pytest

from cocoon_ckpt.dp.accounting.amplified import epsilon
from cocoon_ckpt.dp.accounting.calibration import noise_multiplier_for
from cocoon_ckpt.dp.mechanism import BandMF, MechanismKind
from cocoon_ckpt.dp.plan import Plan, candidate_bands, plan
from cocoon_ckpt.errors import ConfigError

N, B, STEPS, DELTA = 380, 20, 150, 1e-5
PARAMS = 1_000


@pytest.fixture(scope="module")
def plans() -> dict[float, Plan]:
    return {
        eps: plan(
            target_epsilon=eps,
            delta=DELTA,
            dataset_size=N,
            batch_size=B,
            steps=STEPS,
            bands=(4, 1),
            # Given out of order, repeated, as enum and value: rows come sorted, once each.
            mechanisms=("optimized", MechanismKind.BANDED_SQRT, MechanismKind.OPTIMIZED),
            model_params=PARAMS,
        )
        for eps in (2.0, 8.0)
    }


def test_dp_sgd_row_is_dp_sgd(plans: dict[float, Plan]) -> None:
    first = plans[2.0].rows[0]
    assert (first.bands, first.mechanism, first.sampling_rate) == (1, None, B / N)
    assert first.noise_multiplier == noise_multiplier_for(2.0, N, B, STEPS, 1, DELTA)
    # b = 1 is C = [1]: the workload loss is n(n+1)/2, so the error is sigma^2 (n+1)/2.
    assert first.predicted_error == pytest.approx(first.noise_multiplier**2 * (STEPS + 1) / 2)
    assert first.relative_error == 1.0


@pytest.mark.parametrize("eps", [2.0, 8.0])
def test_every_row_reaches_the_target(plans: dict[float, Plan], eps: float) -> None:
    for row in plans[eps].rows:
        spent = epsilon(row.noise_multiplier, N, B, STEPS, row.bands, DELTA)
        # noise_multiplier_for raises sigma in 0.1% steps until the target is met.
        assert eps * 0.99 <= spent <= eps, row
        assert row.sampling_rate == B * row.bands / N
        assert row.rounds == math.ceil(STEPS / row.bands)


def test_rows_sorted_and_error_is_the_scaled_workload_loss(plans: dict[float, Plan]) -> None:
    p = plans[8.0]
    assert [(r.bands, r.label) for r in p.rows] == [
        (1, "dp-sgd"),
        (4, "banded_sqrt"),
        (4, "optimized"),
    ]
    _, sqrt, opt = p.rows
    assert sqrt.noise_multiplier == opt.noise_multiplier  # sigma depends on b only
    want = sqrt.noise_multiplier**2 * BandMF.banded_sqrt(4, STEPS).loss() / STEPS
    assert sqrt.predicted_error == pytest.approx(want, rel=1e-12)
    assert opt.predicted_error <= sqrt.predicted_error
    assert (sqrt.state_bytes_per_param, sqrt.state_bytes, sqrt.step_read_bytes) == (
        12,
        12 * PARAMS,
        12 * PARAMS,
    )
    assert p.rows[0].state_bytes == 0


def test_predicts_bands_pay_at_epsilon_8_and_not_at_2(plans: dict[float, Plan]) -> None:
    """The digits result: b = 4 beat DP-SGD at epsilon 8, b > 1 lost at epsilon 2."""
    at8, at2 = plans[8.0], plans[2.0]
    assert at8.recommendation.bands == 4
    assert at8.recommendation.relative_error < 0.7
    by_label = {r.label: r for r in at2.rows}
    assert by_label["banded_sqrt"].relative_error > 1.0
    # optimized at b = 4 is within a few percent of DP-SGD at epsilon 2: no real gain.
    assert by_label["optimized"].relative_error > 0.9
    best_gain = {eps: 1 - p.recommendation.relative_error for eps, p in plans.items()}
    assert best_gain[8.0] > 5 * best_gain[2.0]


def test_json_round_trip(plans: dict[float, Plan]) -> None:
    p = plans[8.0]
    assert Plan.from_json(p.to_json()) == p
    record = json.loads(p.to_json())
    assert record["kind"] == "Plan" and record["recommended"] == p.recommended
    assert record["rows"][0]["mechanism"] is None
    record["kind"] = "Other"
    with pytest.raises(ValueError, match="expected a Plan"):
        Plan.from_json(json.dumps(record))


def test_render_marks_the_recommendation(plans: dict[float, Plan]) -> None:
    text = plans[8.0].render()
    lines = text.splitlines()
    assert len(lines) == 2 + 3 + 1
    assert [line for line in lines if line.startswith("*")] == [lines[2 + plans[8.0].recommended]]
    assert "recommended: bands=4" in lines[-1]


def test_candidate_bands_follow_the_data() -> None:
    # The digits setting: 60 partitions at most, so 64 bands are out.
    assert candidate_bands(dataset_size=1200, batch_size=20, steps=1500) == (1, 2, 4, 8, 16, 32)
    assert candidate_bands(dataset_size=10_000, batch_size=10, steps=5) == (1, 2, 4)


_GOOD = {"target_epsilon": 2.0, "delta": 1e-5, "dataset_size": 100, "batch_size": 10, "steps": 8}


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"target_epsilon": 0.0}, "target_epsilon"),
        ({"target_epsilon": -1.0}, "target_epsilon"),
        ({"target_epsilon": math.inf}, "target_epsilon"),
        ({"delta": 1.0}, "delta"),
        ({"batch_size": 101}, "batch_size"),
        ({"steps": 0}, "steps"),
        ({"bands": (4, 9)}, "bands"),
        ({"bands": (16,), "steps": 100}, "bands"),  # B b = 160 > N = 100
        ({"bands": ()}, "bands"),
        ({"mechanisms": ("custom",)}, "mechanisms"),
        ({"mechanisms": ()}, "mechanisms"),
        ({"method": "moments"}, "method"),
        ({"model_params": 0}, "model_params"),
    ],
)
def test_bad_input_names_the_argument(change: dict[str, object], named: str) -> None:
    with pytest.raises(ConfigError, match=rf"^Expected {named}="):
        plan(**{**_GOOD, **change})  # type: ignore[arg-type]
