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
    # dp-accounting's composition.
    q = batch * bands / n_data
    acc = Accountant(
        noise_multiplier=sigma, dataset_size=n_data, batch_size=batch, bands=bands, delta=1e-5
    )
    for count in counts:
        acc.steps = count * bands
        assert acc.epsilon() == _direct(sigma, q, count, 1e-5)


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


@pytest.mark.parametrize(
    ("sigma", "q", "interval"),
    [(1.0, 0.125, 1e-4), (0.6, 0.01, 1e-4), (2.5, 0.5, 1e-3), (0.35, 0.3, 1e-2), (1.3, 1.0, 1e-3)],
)
def test_one_round_pld_is_dp_accountings(sigma: float, q: float, interval: float) -> None:
    # The grid-at-once build is dp-accounting's from_gaussian_mechanism, float for float
    # (dense and sparse pmfs, q = 1 included).
    from dp_accounting.pld import privacy_loss_distribution as pld_dist

    from cocoon_ckpt.dp.accounting import pld_gaussian

    assert pld_gaussian._agrees()
    fast = pld_gaussian._build(sigma, q, interval, fast=True)
    want = pld_dist.from_gaussian_mechanism(
        standard_deviation=sigma, value_discretization_interval=interval, sampling_prob=q
    )
    assert pld_gaussian._same(fast, want)
    assert pld_gaussian._same(pld_gaussian.subsampled_gaussian(sigma, q, interval), want)


@pytest.mark.parametrize(
    ("sigma", "n_data", "batch", "bands", "counts", "delta"),
    [
        (0.7, 4_000, 25, 2, [1, 9, 50], 1e-5),
        (1.0, 2_048, 32, 8, [5, 6], 1e-7),
        (3.0, 1_797, 64, 4, [3, 20], 1e-5),
        (1.5, 100_000, 500, 16, [2, 120], 1e-6),
    ],
)
def test_compiled_composition_equals_direct_composition(
    sigma: float, n_data: int, batch: int, bands: int, counts: list[int], delta: float
) -> None:
    # The compiled epsilon loop and tail truncation (checked against dp-accounting's
    # Python loops once per process) give PLDAccountant's epsilon exactly, count by count.
    from cocoon_ckpt.dp.accounting import _pld_kernels

    assert _pld_kernels.agree()
    q = batch * bands / n_data
    for count in counts:
        got = epsilon(sigma, n_data, batch, count * bands, bands, delta)
        assert got == _direct(sigma, q, count, delta)


def test_self_composition_is_dp_accountings_bit_for_bit() -> None:
    # The cached self-composition (compiled spectrum power, prefix copied instead of
    # rolled) gives the very pmf `DensePLDPmf.self_compose` gives, for every count the
    # power takes through binary exponentiation and the counts on either side.
    import numpy as np

    from cocoon_ckpt.dp.accounting import _pld_kernels, pld_composition

    assert _pld_kernels.agree()
    one = pld_composition.one_round(1.0, 0.125, pld_composition.PLD_INTERVAL)
    for composer in (one.remove, one.add):
        assert composer is not None and composer.dense
        for count in (1, 2, 3, 4, 7, 38, 99, 100):
            got = composer.compose(count)
            want = composer.pmf.self_compose(count, pld_composition.TAIL_MASS)
            assert got._lower_loss == want._lower_loss
            assert got._infinity_mass == want._infinity_mass
            assert got._probs.tobytes() == np.asarray(want._probs).tobytes()


def test_compiled_power_is_numpys() -> None:
    import numpy as np

    from cocoon_ckpt.dp.accounting import _pld_kernels

    rng = np.random.default_rng(7)
    z = rng.standard_normal(5000) + 1j * rng.standard_normal(5000)
    z[:4] = [0.0, complex(-0.0, 0.0), complex(3.0, -0.0), 1e-200]
    for n in range(1, 101):
        assert _pld_kernels.int_power(z, n).tobytes() == (z**n).tobytes()


# noise_multiplier_for's answers before the compiled composition (2026-12-03, bench/
# accounting.py): the faster search must return the same sigma to 1e-4.
_CALIBRATED_BEFORE = [
    ((4.0, 10_000, 100, 400, 4), 0.85602),
    ((8.0, 2048, 32, 300, 8), 0.83616),
    ((1.0, 60_000, 256, 1000, 1), 0.88260),
]


@pytest.mark.parametrize(("args", "before"), _CALIBRATED_BEFORE)
def test_noise_multiplier_for_meets_target_exactly_and_matches_before(
    args: tuple[float, int, int, int, int], before: float
) -> None:
    target, n_data, batch, steps, bands = args
    sigma = noise_multiplier_for(target, n_data, batch, steps, bands, 1e-5)
    assert epsilon(sigma, n_data, batch, steps, bands, 1e-5) <= target
    assert _direct(sigma, batch * bands / n_data, math.ceil(steps / bands), 1e-5) <= target
    assert sigma == pytest.approx(before, rel=1e-4)
