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
    # The same value, not a close one: the cached composition is dp-accounting's own.
    assert epsilon(sigma, n_data, batch, steps, bands, 1e-5, method) == want


@pytest.mark.parametrize(
    ("sigma", "n_data", "batch", "bands", "counts"),
    [(1.0, 2048, 32, 8, [2, 38, 37]), (0.9, 20_000, 100, 1, [1, 400])],
)
def test_every_round_count_equals_direct_composition(
    sigma: float, n_data: int, batch: int, bands: int, counts: list[int]
) -> None:
    # A job checkpointing at each new round count: one cached one-round PLD, its cached
    # tail bounds and spectra reused across counts, each count still exactly
    # dp-accounting's composition (and a displayed value never composes by itself).
    q = batch * bands / n_data
    acc = Accountant(
        noise_multiplier=sigma, dataset_size=n_data, batch_size=batch, bands=bands, delta=1e-5
    )
    for count in counts:
        acc.steps = count * bands
        assert acc.known_epsilon() is None or count in counts[: counts.index(count)]
        assert acc.epsilon() == _direct(sigma, q, count, 1e-5)
        assert acc.known_epsilon() == acc.epsilon()


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
    # within 0.2% of the smallest: the coarse-grid search lands next to the answer
    assert epsilon(sigma * 0.998, 10_000, 100, 400, 4, 1e-5) > 4.0


def test_noise_multiplier_for_rdp() -> None:
    sigma = noise_multiplier_for(3.0, 60_000, 256, 500, 1, 1e-5, "rdp")
    assert epsilon(sigma, 60_000, 256, 500, 1, 1e-5, "rdp") <= 3.0
    assert epsilon(sigma * 0.99, 60_000, 256, 500, 1, 1e-5, "rdp") > 3.0


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
