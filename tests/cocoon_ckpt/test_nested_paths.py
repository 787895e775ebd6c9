"""A key file or a store inside a store's tree is refused before anything is written (its
gc and retention would delete them); a part's state that no manifest could hold (nested
past the bound) is refused at the start, and one holding NaN or an infinity is stored
as tagged JSON, never as bare NaN."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from cocoon_ckpt import run_job
from cocoon_ckpt._cli.main import main
from cocoon_ckpt._cli.train import job_options
from cocoon_ckpt.examples import mlp
from cocoon_ckpt.format.part_state import MAX_PART_DEPTH, decode_part_state, encode_part_state
from cocoon_ckpt.train.parts import JobParts
from state import Store
from state.canonical_json import canonical_text, load_bounded

from .conftest import job_config, tree

SMALL = ("--steps", "4", "--bands", "2", "--checkpoint-every", "2", "--no-progress")


def _main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    capsys.readouterr()
    code = main(list(args))
    return code, capsys.readouterr().err


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("nested") / "s.zarr"
    assert main(["train", "--store", str(root), *SMALL]) == 0
    return root


def test_a_key_file_inside_a_store_is_refused_with_nothing_written(
    store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = tree(store)
    # a new job whose key file would lie in another store's versions/ (gc deletes it)
    fresh = tmp_path / "fresh.zarr"
    key = store / "versions" / "k"
    code, err = _main(capsys, "train", "--store", str(fresh), "--key-file", str(key), *SMALL)
    assert code == 2 and err.count("\n") == 1, err
    assert f"--key-file {key} lies inside the store {store}" in err
    assert "keep the key file outside every store" in err
    assert not fresh.exists() and not key.exists() and tree(store) == before
    # a new job whose key file would lie in the store it is about to create
    own_key = fresh / "versions" / "k"
    code, err = _main(capsys, "train", "--store", str(fresh), "--key-file", str(own_key), *SMALL)
    assert code == 2 and f"lies inside the store {fresh}" in err, err
    assert not fresh.exists()
    # a link to a key file inside a store is the file it resolves to
    link = tmp_path / "key-link"
    link.symlink_to(store / "secret" / "noise.key")
    code, err = _main(capsys, "train", "--store", str(store), "--key-file", str(link), *SMALL)
    assert code == 2 and "lies inside the store" in err, err
    code, err = _main(capsys, "audit", str(store), "--key-file", str(link))
    assert code == 2 and "lies inside the store" in err, err
    assert tree(store) == before


def test_a_store_inside_another_store_is_refused_with_nothing_written(
    store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = tree(store)
    for inner in (store / "versions" / "inner.zarr", store / "shared" / "a" / "b.zarr"):
        code, err = _main(capsys, "train", "--store", str(inner), *SMALL)
        assert code == 2 and err.count("\n") == 1, err
        assert f"store {inner} lies inside the cocoon-ckpt store {store}" in err
        assert "choose a store path (--store) outside it" in err
        assert not inner.exists() and tree(store) == before
    # a store planted there by hand is not opened either: gc of the outer store would
    # delete it under the reader
    planted = store / "versions" / "planted.zarr"
    planted.mkdir()
    (planted / "zarr.json").write_bytes((store / "zarr.json").read_bytes())
    code, err = _main(capsys, "inspect", str(planted))
    assert code == 2 and "lies inside the cocoon-ckpt store" in err, err
    (planted / "zarr.json").unlink()
    planted.rmdir()
    # beside the store (not inside it) is fine
    code, err = _main(capsys, "train", "--store", str(tmp_path / "beside.zarr"), *SMALL)
    assert code == 0, err


class Deep:
    """A stateful part whose state nests `depth` lists deep."""

    def __init__(self, depth: int, value: Any = 0) -> None:
        self.depth, self.value = depth, value

    def state_dict(self) -> dict[str, Any]:
        state: Any = self.value
        for _ in range(self.depth):
            state = [state]
        return {"nested": state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class Odd:
    """A stateful part holding the numbers JSON does not have."""

    def __init__(self) -> None:
        self.best = math.inf
        self.values = [math.nan, -math.inf, 1.5]

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "values": list(self.values)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best = state["best"]
        self.values = list(state["values"])


def _with(stateful: dict[str, Any]) -> Any:
    def build(config: Any) -> JobParts:
        base = mlp.build(config)
        return JobParts(
            model=base.model,
            optimizer=base.optimizer,
            loss_fn=base.loss_fn,
            dataset=base.dataset,
            stateful=stateful,
        )

    return build


@pytest.mark.parametrize("depth", [MAX_PART_DEPTH + 1, 5000])
def test_a_deeply_nested_part_state_is_refused_before_anything_is_written(
    tmp_path: Path, depth: int
) -> None:
    url = str(tmp_path / "s.zarr")
    with pytest.raises(Exception, match=f"nests deeper than {MAX_PART_DEPTH} levels") as e:
        run_job(job_config("mlp", bands=2, steps=4), url, parts=_with({"deep": Deep(depth)}))
    assert "stateful/deep" in str(e.value) and type(e.value).__name__ == "ConfigError"
    assert not Path(url).exists()


def test_the_deepest_part_state_allowed_fits_a_manifest() -> None:
    """Dicts cost the most JSON levels ({"dict": [[key, value]]}): the deepest state of
    dicts a part may have still fits a manifest's bound, with the manifest's own levels."""
    state: Any = 0.5
    for _ in range(MAX_PART_DEPTH):
        state = {"k": state}
    arrays: dict[str, Any] = {}
    record = encode_part_state(state, "stateful/deep", arrays)
    doc = {"records": {"stateful": {"deep": {"kind": "Deep", "state": record}}}}
    assert load_bounded(canonical_text(doc)) == doc
    assert decode_part_state(record, arrays.__getitem__) == state
    with pytest.raises(TypeError, match="nests deeper than"):
        encode_part_state({"k": state}, "stateful/deep", None)


def test_non_finite_numbers_in_a_part_state_are_tagged_never_bare(tmp_path: Path) -> None:
    url = str(tmp_path / "s.zarr")
    run_job(job_config("mlp", bands=2, steps=4), url, parts=_with({"odd": Odd()}))
    latest = Store.open(url, create=False).latest()
    assert latest is not None
    for path in (tmp_path / "s.zarr" / "manifests").glob("*.json"):
        text = path.read_text()
        assert "NaN" not in text and "Infinity" not in text
        json.loads(text, parse_constant=lambda c, p=path: pytest.fail(f"bare {c} in {p.name}"))
    state = decode_part_state(latest.records["stateful"]["odd"]["state"], latest.array)
    assert state["best"] == math.inf and state["values"][1:] == [-math.inf, 1.5]
    assert math.isnan(state["values"][0])


def test_a_deeply_nested_job_option_is_text_not_a_recursion_error() -> None:
    deep = "[" * 100_000 + "]" * 100_000
    opts = job_options([f"deep={deep}", "big=1" + "0" * 5000, "nan=NaN", "ok=[1, 2]"])
    assert opts == {"deep": deep, "big": "1" + "0" * 5000, "nan": "NaN", "ok": [1, 2]}


def test_a_deeply_nested_config_or_tiers_is_a_named_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    deep = "[" * 5000 + "]" * 5000
    cfg = tmp_path / "job.json"
    cfg.write_text('{"job": "example:mlp", "dp": ' + deep + "}")
    store = tmp_path / "s.zarr"
    code, err = _main(capsys, "train", "--config", str(cfg), "--store", str(store))
    assert code == 2 and err.count("\n") == 1, err
    assert f"--config {cfg}: not valid JSON (nested deeper than 128 levels" in err
    code, err = _main(capsys, "train", "--store", str(store), "--tiers", deep, *SMALL)
    assert code == 2 and "--tiers is not valid JSON (nested deeper than 128 levels" in err, err
    assert not store.exists()
