"""`cocoon-ckpt plan`: the table, the JSON, and bad input as one line with exit 2."""

from __future__ import annotations

import pytest

from cocoon_ckpt._cli.main import main
from cocoon_ckpt.dp.accounting.amplified import epsilon
from cocoon_ckpt.dp.plan import Plan

SETTING = ["--delta", "1e-5", "--dataset-size", "400", "--batch-size", "20", "--steps", "64"]


def test_plan_json_rows_reach_the_target(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["plan", "--target-epsilon", "4", *SETTING, "--bands", "1,4", "--json"])
    assert code == 0
    out = Plan.from_json(capsys.readouterr().out)
    assert {(r.bands, r.mechanism) for r in out.rows} == {
        (1, None), (4, "banded_sqrt"), (4, "optimized"),
    }  # fmt: skip
    for row in out.rows:  # every calibrated sigma gives the target, and not much less
        eps = epsilon(row.noise_multiplier, 400, 20, 64, row.bands, 1e-5)
        assert 0.98 * 4 <= eps <= 4.0 + 1e-9
    best = out.rows[out.recommended]
    assert best.predicted_error == min(r.predicted_error for r in out.rows)


def test_plan_text_marks_the_recommendation(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["plan", "--target-epsilon", "4", *SETTING, "--bands", "1", "--params", "1000"])
    assert code == 0
    text = capsys.readouterr().out
    assert "recommended: bands=1" in text and "dp-sgd" in text


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--target-epsilon", "-1", *SETTING], "target_epsilon"),
        (["--target-epsilon", "4", *SETTING, "--bands", "x"], "--bands"),
        (["--target-epsilon", "4", *SETTING, "--bands", "500"], "bands"),
    ],
)
def test_plan_bad_input_is_one_line_exit_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], says: str
) -> None:
    code = main(["plan", *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and says in err, err
