"""What a user sees when a store's files were replaced by hostile ones: FIFOs in place of
a manifest, a chunk or the key (refused by name at once, never a hang), a `manifests/`
folder linked out of the store, and manifests re-stamped around a nesting or a number
`json` cannot parse. train, gc, inspect and audit name the damaged version, and
`--allow-fallback`, `gc --discard-damaged` and audit work around it as around any other
damage."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cocoon_ckpt._cli.main import main
from state import restamp

SMALL = ("--steps", "4", "--bands", "2", "--checkpoint-every", "2", "--no-progress")
# The code never blocks on a FIFO: these turn a regression into a failure, not a hang.
_NO_HANG = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def committed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished two-version store (steps 2 and 4), its key inside."""
    root = tmp_path_factory.mktemp("hostile") / "s.zarr"
    assert main(["train", "--store", str(root), *SMALL]) == 0
    assert sorted(p.name for p in (root / "manifests").iterdir()) == [
        "00000001.json",
        "00000002.json",
    ]
    return root


def _copy(committed: Path, tmp_path: Path) -> Path:
    store = tmp_path / "s.zarr"
    shutil.copytree(committed, store, symlinks=True)
    return store


def _fifo_at(path: Path) -> None:
    path.unlink()
    os.mkfifo(path, 0o600)


def _main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


@_NO_HANG
def test_a_fifo_manifest_is_named_by_every_command_and_worked_around(
    committed: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = _copy(committed, tmp_path)
    _fifo_at(store / "manifests" / "00000002.json")
    said = "version 2 of"
    fifo = "manifests/00000002.json is a FIFO, not a regular file"
    # the real entry point, in a process of its own: a refusal, at once
    run = subprocess.run(
        [sys.executable, "-m", "cocoon_ckpt", "train", "--store", str(store), *SMALL],
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert run.returncode == 1 and run.stderr.count("\n") == 1, run.stderr
    assert said in run.stderr and fifo in run.stderr
    assert "rerun with --allow-fallback to use version 1" in run.stderr

    code, out, err = _main(capsys, "inspect", str(store))
    assert code == 0 and "versions [2] fail to verify" in out, out + err
    code, out, err = _main(capsys, "gc", str(store), "--keep", "2")
    assert code == 1 and fifo in err and "nothing was deleted" in err, err
    code, out, err = _main(capsys, "audit", str(store), "--seed", "0")
    assert code == 1 and "FINDING [chain] (version 2)" in out and fifo in out, out + err
    code, out, err = _main(capsys, "train", "--store", str(store), *SMALL, "--allow-fallback")
    assert code == 0 and "resumed from step 2" in out, out + err
    code, out, err = _main(capsys, "gc", str(store), "--keep", "2", "--discard-damaged")
    assert code == 0, err
    assert not (store / "manifests" / "00000002.json").exists()


@_NO_HANG
def test_a_fifo_chunk_is_damage_named_and_fallen_back_from(
    committed: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = _copy(committed, tmp_path)
    doc = json.loads((store / "manifests" / "00000002.json").read_text())
    path = next(
        meta["path"]
        for meta in doc["arrays"].values()
        if meta["path"].startswith("versions/00000002") and meta["shape"]
    )
    chunk = next(p for p in (store / path).iterdir() if p.name.startswith("c"))
    _fifo_at(chunk)
    code, out, err = _main(capsys, "train", "--store", str(store), *SMALL)
    assert code == 1 and "version 2 of" in err and "not a regular file" in err, err
    code, out, err = _main(capsys, "train", "--store", str(store), *SMALL, "--allow-fallback")
    assert code == 0 and "resumed from step 2" in out, out + err


@_NO_HANG
def test_a_fifo_key_file_is_refused_at_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    key = tmp_path / "noise.key"
    os.mkfifo(key, 0o600)
    store = tmp_path / "k.zarr"
    code, out, err = _main(capsys, "train", "--store", str(store), "--key-file", str(key), *SMALL)
    assert code == 2 and f"key file {key} is not a regular file" in err, err
    assert not store.exists()
    kept = tmp_path / "kept.zarr"
    real_key = tmp_path / "real.key"
    code, out, err = _main(
        capsys, "train", "--store", str(kept), "--key-file", str(real_key), *SMALL
    )
    assert code == 0, err
    code, out, err = _main(capsys, "audit", str(kept), "--key-file", str(key))
    assert code == 2 and f"key file {key} is not a regular file" in err, out + err


def test_a_manifests_folder_linked_out_of_the_store_is_refused(
    committed: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = _copy(committed, tmp_path)
    outside = tmp_path / "elsewhere"
    (store / "manifests").rename(outside)
    (store / "manifests").symlink_to(outside)
    code, out, err = _main(capsys, "inspect", str(store))
    assert "versions [1, 2] fail to verify" in out, out + err
    code, out, err = _main(capsys, "train", "--store", str(store), *SMALL)
    assert code == 1 and "outside the store" in err and "version 2" in err, err
    code, out, err = _main(capsys, "gc", str(store), "--keep", "2")
    assert code == 1 and "nothing was deleted" in err, err
    assert sorted(p.name for p in outside.iterdir()) == ["00000001.json", "00000002.json"]


def _forge(store: Path, version: int, text: str) -> None:
    """Version `version`'s manifest with a record holding `text`, re-stamped as a writer
    who recomputes the checksums would (the text goes in for a placeholder after
    re-stamping: the bounds refuse the bytes before any checksum is looked at)."""
    path = store / "manifests" / f"{version:08d}.json"
    doc = json.loads(path.read_bytes())
    doc["records"]["planted"] = "@@placeholder@@"
    path.write_bytes(restamp(doc).replace(b'"@@placeholder@@"', text.encode()))


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("[" * 5000 + "]" * 5000, "nested deeper than 128 levels"),
        ("1" + "0" * 5000, "a number of 5001 characters"),
    ],
)
def test_a_restamped_hostile_manifest_is_damage_the_fallback_gc_and_audit_pass_over(
    committed: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, said: str
) -> None:
    store = _copy(committed, tmp_path)
    _forge(store, 2, text)
    code, out, err = _main(capsys, "train", "--store", str(store), *SMALL)
    assert code == 1 and err.count("\n") == 1, err
    assert "version 2 of" in err and said in err and "record 'planted'" in err, err
    code, out, err = _main(capsys, "audit", str(store), "--seed", "0")
    assert code == 1 and "FINDING [chain] (version 2)" in out and said in out, out + err
    code, out, err = _main(capsys, "gc", str(store), "--keep", "2")
    assert code == 1 and "nothing was deleted" in err, err
    code, out, err = _main(capsys, "train", "--store", str(store), *SMALL, "--allow-fallback")
    assert code == 0 and "resumed from step 2" in out, out + err
    code, out, err = _main(capsys, "gc", str(store), "--keep", "2", "--discard-damaged")
    assert code == 0, err
    code, out, err = _main(capsys, "audit", str(store), "--seed", "0")
    assert code == 0, out + err


def test_planted_lease_records_neither_crash_nor_block_the_store(
    committed: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = _copy(committed, tmp_path)
    leases = store / "leases"
    newest = max(int(p.stem) for p in leases.glob("*.json"))
    planted = leases / f"{newest + 1:08d}.json"
    deep = "[" * 5000 + "]" * 5000
    planted.write_text(f'{{"generation": {newest + 1}, "x": {deep}}}')
    before = sorted(p.name for p in (store / "manifests").iterdir())
    code, out, err = _main(capsys, "train", "--store", str(store), *SMALL)
    assert code == 1 and err.count("\n") == 1, err
    assert f"leases/{newest + 1:08d}.json is not a lease record" in err and "--takeover" in err
    assert sorted(p.name for p in (store / "manifests").iterdir()) == before
    code, out, err = _main(capsys, "train", "--store", str(store), *SMALL, "--takeover")
    assert code == 0, out + err
    # a live-looking writer on another host, its renewal a clock could never give:
    # expired, not alive for ever
    gen = max(int(p.stem) for p in leases.glob("*.json")) + 1
    record = {
        "owner": "elsewhere:1:x",
        "generation": gen,
        "host": "another-host",
        "pid": 1,
        "acquired": "2026-01-01T00:00:00+00:00",
        "renewed": 1e308,
        "expiry_s": 60.0,
    }
    (leases / f"{gen:08d}.json").write_text(json.dumps(record))
    code, out, err = _main(capsys, "train", "--store", str(store), *SMALL)
    assert code == 0, out + err
    # a generation planted far beyond the sequence is no generation
    (leases / f"{10**15:08d}.json").write_text(json.dumps({**record, "generation": 10**15}))
    code, out, err = _main(capsys, "train", "--store", str(store), *SMALL)
    assert code == 0, out + err
