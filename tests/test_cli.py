"""The real entry point, in subprocesses: exit codes, JSON, one-line errors."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cocoon_ckpt._cli.exits import FAILURE
from cocoon_ckpt._cli.main import main
from state import Store


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cocoon_ckpt", *args], capture_output=True, text=True, timeout=300
    )


def test_train_resume_export_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = str(tmp_path / "s.zarr")
    common = [
        "train",
        "--example",
        "mlp",
        "--store",
        store,
        "--steps",
        "12",
        "--checkpoint-every",
        "4",
        "--no-progress",
        "--json",
    ]
    first = _run(*common)
    assert first.returncode == 0, first.stderr
    out = json.loads(first.stdout)
    assert out["steps"] == 12 and out["resumed_from"] is None and out["epsilon"] > 0
    # a finished job: resumes at the end, trains nothing more (the same entry point in
    # this process: a second interpreter and torch start prove nothing more)
    code, again, _ = _main(capsys, *common)
    assert code == 0 and json.loads(again)["resumed_from"] == 12
    exp = _run("export", store, "--out", str(tmp_path / "m.pt"), "--json")
    assert exp.returncode == 0, exp.stderr
    report = json.loads(exp.stdout)
    assert report["threat_model"] == "intermediate_iterates" and report["bands"] == 8
    state = torch.load(tmp_path / "m.pt")
    assert set(state) == {"0.weight", "0.bias", "2.weight", "2.bias"}  # no noise state
    assert json.loads((tmp_path / "m.pt.privacy.json").read_text())["epsilon"] == report["epsilon"]


def test_errors_are_one_line_with_exit_codes(
    committed: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = str(tmp_path / "s.zarr")
    shutil.copytree(committed / "s.zarr", store)
    code, _, err = _main(capsys, "train", "--store", store, "--steps", "4", "--bands", "1")
    assert code == 1  # a valid request the store refused
    assert err.count("\n") == 1 and "dp.bands: stored 2, now 1" in err
    code, _, err = _main(capsys, "export", str(tmp_path / "nothing"), "--out", "x.pt")
    assert code == 2 and "holds no cocoon-ckpt store" in err
    assert not (tmp_path / "nothing").exists()  # export creates nothing


def _tree(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): f"{p.lstat().st_mode:o}:"
        + (hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "")
        for p in sorted(root.rglob("*"))
    }


def test_inspect_audit_diff_gc_in_subprocesses(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each command once in a subprocess (the real entry point); their repeats, which
    check other flags and states, through the same entry point in this process."""
    store = str(tmp_path / "s.zarr")
    first = _run(
        "train", "--store", store, "--steps", "12", "--checkpoint-every", "3", "--bands", "4",
        "--no-progress",
    )  # fmt: skip
    assert first.returncode == 0, first.stderr
    insp = _run("inspect", store, "--json")
    assert insp.returncode == 0, insp.stderr
    out = json.loads(insp.stdout)
    versions = [v["version"] for v in out["versions"]]
    assert [v["step"] for v in out["versions"]] == [6, 9, 12]  # keep_last 3
    assert out["job"]["threat_model"] == "intermediate_iterates"
    # retention ran after every commit: nothing is left for gc, every byte is referenced
    space = out["space"]
    assert space["unreachable_bytes"] == 0 and space["unreadable_versions"] == []
    assert space["referenced_bytes"] > 0
    assert space["data_ratio"] <= 1.05
    code, text, _ = _main(capsys, "inspect", store)
    assert code == 0 and "on host, 3 slots" in text
    assert "unreachable 0 B (gc reclaims it)" in text
    one = json.loads(_main(capsys, "inspect", store, "--version", str(versions[-1]), "--json")[1])
    assert one["config"]["dp"]["steps"] == 12

    # the recorded config reruns the same job: nothing left to train
    cfg = tmp_path / "job.json"
    cfg.write_text(json.dumps(one["config"]))
    code, again, err = _main(
        capsys, "train", "--config", str(cfg), "--store", store, "--no-progress", "--json"
    )
    assert code == 0, err
    assert json.loads(again)["resumed_from"] == 12

    audit = _run("audit", store, "--json", "--plot", str(tmp_path / "plots"))
    assert audit.returncode == 0, audit.stdout + audit.stderr
    rep = json.loads(audit.stdout)
    assert rep["ok"] and rep["checks"]["noise"]["slots"] > 0 and len(rep["plots"]) == 4
    assert "all checks hold" in _main(capsys, "audit", store, "--seed", "1")[1]

    d = _run("diff", store, str(versions[0]), str(versions[1]), "--json")
    assert d.returncode == 0 and json.loads(d.stdout)["records_changed"]["trainer.step"] == {
        "from": 6,
        "to": 9,
    }
    assert "arrays added" in _main(capsys, "diff", store, str(versions[0]), str(versions[1]))[1]

    os.chmod(store, 0o755)  # anyone may now list and read the store
    code, out, _ = _main(capsys, "audit", store)
    assert code == 1 and "FINDING [permissions]" in out
    os.chmod(store, 0o700)

    gc = _run("gc", store, "--keep", "2", "--json")
    assert gc.returncode == 0, gc.stderr
    assert json.loads(gc.stdout)["versions_kept"] == versions[1:]
    assert _main(capsys, "audit", store)[0] == 0


def _main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """`cocoon-ckpt ARGS` in this process (no interpreter and torch start per case)."""
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


WRONG_SIGNATURE_JOB = """
from cocoon_ckpt.examples import mlp

def build():
    return mlp.build(None)
"""


@pytest.fixture(scope="module")
def committed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A committed store with its key inside, and one whose key is in a key file."""
    root = tmp_path_factory.mktemp("cli")
    small = ("--steps", "4", "--bands", "2", "--checkpoint-every", "2", "--no-progress")
    assert main(["train", "--store", str(root / "s.zarr"), *small]) == 0
    key = str(root / "key")
    assert main(["train", "--store", str(root / "k.zarr"), "--key-file", key, *small]) == 0
    return root


def test_bad_input_is_one_line_exit_2_and_changes_nothing(
    committed: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    shutil.copytree(committed, tmp_path, dirs_exist_ok=True)
    store, keyed = tmp_path / "s.zarr", tmp_path / "k.zarr"
    newer = tmp_path / "newer.zarr"
    shutil.copytree(store, newer)
    root = json.loads((newer / "zarr.json").read_text())
    root["attributes"]["cocoon_ckpt"]["format_version"] = 99
    (newer / "zarr.json").write_text(json.dumps(root))
    (tmp_path / "notastore").mkdir()
    (tmp_path / "notastore" / "mine.txt").write_text("a user's file")
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "zarr.json").write_text('{"zarr_format": 3, "node_type": "group"}')
    (tmp_path / "afile").write_text("not a folder")
    (tmp_path / "bad.json").write_text("{not json")
    rec = json.loads((tmp_path / "s.zarr" / "manifests").glob("*.json").__next__().read_text())
    (tmp_path / "async_no.json").write_text(
        json.dumps({**rec["records"]["config"], "async_checkpoint": "no"})
    )
    (tmp_path / "open.key").write_bytes(b"k" * 32)
    os.chmod(tmp_path / "open.key", 0o644)
    (tmp_path / "wrongsig.py").write_text(WRONG_SIGNATURE_JOB)
    monkeypatch.syspath_prepend(str(tmp_path))
    fresh = str(tmp_path / "fresh.zarr")
    long = str(tmp_path / ("x" * 300) / "s.zarr")
    train = ("train", "--no-progress", "--steps", "4", "--bands", "2")
    cases = [
        (("inspect", str(tmp_path / "notastore")), "holds no cocoon-ckpt store"),
        (("audit", str(tmp_path / "notastore")), "holds no cocoon-ckpt store"),
        (("gc", str(tmp_path / "notastore"), "--keep", "2"), "holds no cocoon-ckpt store"),
        (("train", "--store", str(tmp_path / "notastore"), "--no-progress"), "notastore"),
        (("inspect", str(newer)), "upgrade cocoon-ckpt"),
        (("audit", str(newer)), "upgrade cocoon-ckpt"),
        (("train", "--store", str(newer), "--no-progress"), "upgrade cocoon-ckpt"),
        (("audit", str(keyed)), "--key-file"),
        (("audit", str(keyed), "--key-file", str(tmp_path / "nokey")), "cannot read key file"),
        ((*train, "--store", str(keyed)), "--key-file"),
        ((*train, "--store", str(keyed), "--key-file", str(tmp_path / "open.key")), "chmod 600"),
        ((*train, "--store", fresh, "--key-file", str(tmp_path / "open.key")), "chmod 600"),
        (("inspect", str(store), "--version", "99"), "has no version 99"),
        (("diff", str(store), "1", "99"), "has no version 99"),
        (
            ("train", "--config", str(tmp_path / "bad.json"), "--store", str(store)),
            "not valid JSON",
        ),
        (("train", "--config", str(tmp_path / "none.json"), "--store", str(store)), "cannot read"),
        (("train", "--config", str(tmp_path / "bad.json"), "--steps", "3"), "drop --steps"),
        (
            ("train", "--config", str(tmp_path / "async_no.json"), "--store", fresh),
            "JobConfig.async_checkpoint='no'",
        ),
        (("gc", str(store), "--keep", "1"), "--keep=1 must be >= 2"),
        (("audit", str(store), "--coordinates", "0"), "coordinates=0"),
        (("audit", str(store), "--seed", "-1"), "a seed is an integer >= 0"),
        ((*train, "--store", fresh, "--lease-expiry", "0"), "--lease-expiry 0.0 must be"),
        ((*train, "--store", fresh, "--lease-expiry", "1e9"), "at most 86400"),
        (("--log-level", "BOGUS", "inspect", str(store)), "'BOGUS' is not one of"),
        (("train", "--steps", "many"), "invalid int value"),
        ((*train, "--store", fresh, "--lr", "inf"), "--lr inf must be finite"),
        ((*train, "--store", fresh, "--lr", "-1"), "--lr -1.0 must"),
        ((*train, "--store", fresh, "--noise-multiplier", "nan"), "--noise-multiplier nan must"),
        ((*train, "--store", fresh, "--steps", str(10**30)), "--steps 10000"),
        ((*train, "--store", fresh, "--delta", "1"), "--delta 1.0 must"),
        ((*train, "--store", fresh, "--tiers", '{"host_bytes": true}'), "host_bytes=True"),
        ((*train, "--store", fresh, "--tiers", '{"hots_bytes": 1}'), "TierConfig"),
        ((*train, "--store", fresh, "--storage-options", '{"anon": "no"}'), 'anon="no"'),
        ((*train, "--store", fresh, "--storage-options", "[1]"), "must be a JSON object"),
        ((*train, "--store", ""), "--store=''"),
        ((*train, "--store", fresh, "--job", "wrongsig:build"), "function of one argument"),
        ((*train, "--store", fresh, "--job", "nosuchmodule:build"), "cannot import module"),
        (("inspect", str(tmp_path / "afile")), "is a file"),
        ((*train, "--store", str(tmp_path / "afile")), "is a file"),
        (("inspect", str(tmp_path / "plain")), "not a cocoon-ckpt store root"),
        ((*train, "--store", str(tmp_path / "plain")), "not a cocoon-ckpt store root"),
        (("inspect", long), "File name too long"),
        ((*train, "--store", long), "File name too long"),
    ]
    before = _tree(tmp_path)
    for args, needle in cases:
        code, out, err = _main(capsys, *args)
        assert code == 2, (args, code, err)
        assert err.count("\n") == 1 and needle in err, (args, err)
        assert err.startswith("cocoon-ckpt: error: ") and out == "", (args, out)
    assert _tree(tmp_path) == before
    assert not (tmp_path / "nokey").exists()


def test_storage_errors_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("s3fs")
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no credential probe
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    opts = {"endpoint_url": closed, "config_kwargs": {"retries": {"max_attempts": 1}}}
    code, _, err = _main(
        capsys, "inspect", "s3://bucket/run.zarr", "--storage-options", json.dumps(opts)
    )
    assert code == 2 and err.count("\n") == 1 and "no usable S3 credentials" in err, err
    opts |= {"key": "k", "secret": "s"}
    code, _, err = _main(
        capsys, "inspect", "s3://bucket/run.zarr", "--storage-options", json.dumps(opts)
    )
    assert (
        code == FAILURE and err.count("\n") == 1 and "cannot reach the storage endpoint" in err
    ), err


def test_ctrl_c_outside_training_is_exit_130_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import cocoon_ckpt.tools.catalog

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(cocoon_ckpt.tools.catalog, "inspect_store", interrupted)
    code, _, err = _main(capsys, "inspect", str(tmp_path))
    assert code == 130 and err == "cocoon-ckpt: interrupted\n"


def test_a_closed_pipe_ends_quietly(tmp_path: Path) -> None:
    Store.open(str(tmp_path / "s.zarr"))  # an empty store: inspect prints a few lines
    read, write = os.pipe()
    os.close(read)  # the reader (`| head`) is already gone
    try:
        res = subprocess.run(
            [sys.executable, "-m", "cocoon_ckpt", "inspect", str(tmp_path / "s.zarr")],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(write)
    assert res.returncode == 141 and res.stderr == ""


def test_help_explains_every_subcommand() -> None:
    top = _run("--help")
    for cmd in ("train", "export", "inspect", "audit", "diff", "gc", "chaos"):
        assert cmd in top.stdout
        sub = _run(cmd, "--help")
        assert sub.returncode == 0 and "usage: cocoon-ckpt " + cmd in sub.stdout
    assert "(default 256" in _run("audit", "--help").stdout


def test_train_on_far_tier_and_inspect_shows_placement(tmp_path: Path) -> None:
    store = str(tmp_path / "far.zarr")
    tiers = json.dumps({"host_bytes": 0, "far_bytes": 1 << 28, "far_dir": str(tmp_path)})
    res = _run(
        "train", "--store", store, "--steps", "6", "--checkpoint-every", "3", "--bands", "3",
        "--tiers", tiers, "--no-progress",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "on far, 2 slots" in _run("inspect", store).stdout
    assert [p.name for p in tmp_path.iterdir()] == ["far.zarr"]  # the far folder is gone
    bad = _run("train", "--store", store, "--tiers", '{"hots_bytes": 1}', "--no-progress")
    assert bad.returncode == 2 and "--tiers" in bad.stderr and "TierConfig" in bad.stderr


def test_lease_expiry_reaches_the_writer_lease(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--lease-expiry is what the lease record carries (what another host judges by),
    and a resume may change it (harmless)."""
    store = str(tmp_path / "s.zarr")
    small = ("--steps", "4", "--bands", "2", "--checkpoint-every", "2", "--no-progress")
    assert main(["train", "--store", store, *small, "--lease-expiry", "7.5"]) == 0
    leases = sorted((tmp_path / "s.zarr" / "leases").glob("*.json"))
    assert json.loads(leases[-1].read_text())["expiry_s"] == 7.5
    assert main(["train", "--store", store, *small, "--lease-expiry", "30"]) == 0
    leases = sorted((tmp_path / "s.zarr" / "leases").glob("*.json"))
    assert json.loads(leases[-1].read_text())["expiry_s"] == 30
    capsys.readouterr()


def test_gc_stops_on_a_damaged_manifest_unless_told_to_discard_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = tmp_path / "s.zarr"
    small = ("--steps", "8", "--bands", "2", "--checkpoint-every", "2", "--no-progress")
    assert main(["train", "--store", str(store), *small]) == 0
    manifests = sorted((store / "manifests").glob("*.json"))
    assert len(manifests) == 3
    oldest = manifests[0]
    data = bytearray(oldest.read_bytes())
    data[len(data) // 2] ^= 0x04  # one bit, in the middle of its records
    oldest.write_bytes(bytes(data))
    capsys.readouterr()
    before = _tree(tmp_path)
    code, out, err = _main(capsys, "gc", str(store), "--keep", "2")
    assert code == 1 and err.count("\n") == 1, err
    assert f"version {int(oldest.stem)}" in err and "nothing was deleted" in err, err
    assert _tree(tmp_path) == before
    code, out, err = _main(capsys, "gc", str(store), "--keep", "2", "--discard-damaged", "--json")
    assert code == 0, err
    assert json.loads(out)["versions_kept"] == [int(m.stem) for m in manifests[1:]]
    assert not oldest.exists()
    code, out, err = _main(capsys, "audit", str(store), "--seed", "0")
    assert code == 0, out + err
