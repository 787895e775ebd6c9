import math

import dp_accounting
import pytest
from dp_accounting import pld, rdp

from cocoon_ckpt import Accountant, epsilon, noise_multiplier_for


def _direct(sigma: float, q: float, count: int, delta: float, method: str = "pld") -> float:
    acc = pld.PLDAccountant() if method == "pld" else rdp.RdpAccountant()
    acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), count)
    return float(acc.get_epsilon(delta))


@pytest.mark.parametrize(
    ("sigma", "n_data", "batch", "steps", "bands"),
    [
        (1.0, 10_000, 100, 500, 1),
        (0.8, 50_000, 250, 1000, 8),
        (1.5, 20_000, 50, 300, 32),
        (2.0, 6_000, 60, 101, 4),
    ],
)
@pytest.mark.parametrize("method", ["pld", "rdp"])
def test_matches_direct_composition(
    sigma: float, n_data: int, batch: int, steps: int, bands: int, method: str
) -> None:
    want = _direct(sigma, batch * bands / n_data, math.ceil(steps / bands), 1e-5, method)
    assert epsilon(sigma, n_data, batch, steps, bands, 1e-5, method) == pytest.approx(
        want, rel=1e-9
    )


def test_b1_is_standard_dp_sgd() -> None:
    assert epsilon(1.1, 60_000, 256, 1000, 1, 1e-5) == pytest.approx(
        _direct(1.1, 256 / 60_000, 1000, 1e-5), rel=1e-12
    )


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"noise_multiplier": 0.0}, "noise_multiplier"),
        ({"noise_multiplier": -1.0}, "noise_multiplier"),
        ({"batch_size": 20_000}, "batch_size"),
        ({"delta": 0.0}, "delta"),
        ({"delta": 1.0}, "delta"),
        ({"bands": 0}, "bands"),
        ({"steps": 0}, "steps"),
    ],
)
def test_bad_arguments_name_the_argument(kw: dict[str, float], match: str) -> None:
    args = {
        "noise_multiplier": 1.0,
        "dataset_size": 10_000,
        "batch_size": 100,
        "steps": 100,
        "bands": 2,
        "delta": 1e-5,
        **kw,
    }
    with pytest.raises(ValueError, match=match):
        epsilon(**args)  # type: ignore[arg-type]


def test_noise_multiplier_for_inverts_epsilon() -> None:
    sigma = noise_multiplier_for(4.0, 10_000, 100, 400, 4, 1e-5)
    assert epsilon(sigma, 10_000, 100, 400, 4, 1e-5) <= 4.0
    assert epsilon(sigma * 0.99, 10_000, 100, 400, 4, 1e-5) > 4.0


def test_accountant_tracks_steps_and_refuses_other_state() -> None:
    acc = Accountant(noise_multiplier=1.0, dataset_size=10_000, batch_size=100, bands=4, delta=1e-5)
    assert acc.epsilon() == 0.0
    acc.step(37)
    assert acc.epsilon() == pytest.approx(epsilon(1.0, 10_000, 100, 37, 4, 1e-5))
    other = Accountant(
        noise_multiplier=1.0, dataset_size=10_000, batch_size=100, bands=4, delta=1e-5
    )
    other.load_state_dict(acc.state_dict())
    assert other.steps == 37
    wrong = Accountant(
        noise_multiplier=2.0, dataset_size=10_000, batch_size=100, bands=4, delta=1e-5
    )
    with pytest.raises(ValueError, match="accountant state"):
        wrong.load_state_dict(acc.state_dict())
    assert acc.state_dict()["event"]["count"] == 10


def test_from_state_dict_rebuilds_the_same_epsilon() -> None:
    acc = Accountant(noise_multiplier=1.2, dataset_size=8_000, batch_size=80, bands=2, delta=1e-6)
    acc.step(21)
    again = Accountant.from_state_dict(acc.state_dict(with_epsilon=False))
    assert again.steps == 21 and again.epsilon() == acc.epsilon()
