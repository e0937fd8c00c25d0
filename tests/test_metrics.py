"""metrics.jsonl's writer with Weights & Biases beside it (convit_scale/metrics.py), offline: what W&B holds equals
metrics.jsonl; the run's name from its folder; one W&B run per run folder across a resume; rank 0 only."""

from __future__ import annotations

import json
import math
import struct
import sys
from pathlib import Path

import pytest

from convit_scale.config import LogConfig
from convit_scale.errors import BadInput
from convit_scale.metrics import (
    WANDB_ID_FILE,
    MetricsWriter,
    check_log_backends,
    read_records,
    run_name,
    scalars,
    wandb_mode,
    wandb_options,
)


def _records(steps: range) -> list[dict]:
    out = []
    for s in steps:
        out.append({"kind": "train", "step": s, "epoch": s // 3, "loss": 2.5 / s, "lr": 1e-4 * s,
                    "images_per_s": 100.0 + s, "peak_mem_mb": [10.0 * s, 11.0 * s], "skipped": False})
        if s % 3 == 0:
            out.append({"kind": "eval", "step": s, "epoch": s // 3, "top1": 10.0 * s, "top5": 12.5 * s,
                        "samples": 200, "checkpoint": "runs/x/checkpoints/step_3"})
    out[1]["loss"] = math.nan  # a skipped step: null in metrics.jsonl, not sent to W&B
    return out


def test_run_name_is_the_folder_below_runs():
    assert run_name("runs/table1/convit_small") == "table1/convit_small"
    assert run_name("/scratch/me/runs/table3/a_full") == "table3/a_full"
    assert run_name("/data/out/demo") == "demo"
    log = LogConfig(wandb=True)
    assert wandb_options(log, "runs/table2/deit_small_f0.1", {}).name == "table2/deit_small_f0.1"
    assert wandb_options(LogConfig(wandb=True, wandb_name="mine"), "runs/a", {}).name == "mine"
    assert wandb_options(LogConfig(), "runs/a", {}) is None


def test_wandb_mode(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_mode("offline") == ("offline", "log.wandb_mode = offline")
    assert wandb_mode("auto")[0] == "disabled"
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", "/nonexistent")  # no ~/.netrc: no key
    mode, why = wandb_mode("auto")
    assert mode == "offline" and "no API key" in why
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # nothing listens on the discard port
    mode, why = wandb_mode("auto")
    assert mode == "offline" and "127.0.0.1:9 does not answer" in why


def test_a_missing_package_is_refused_naming_the_key(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # what `import wandb` raises ImportError for
    with pytest.raises(BadInput, match=r"log.wandb = true needs the wandb package: pip install wandb"):
        check_log_backends(LogConfig(wandb=True))
    check_log_backends(LogConfig())  # not asked for: not needed


# -- offline W&B ---------------------------------------------------------------------------------------------------
def _wandb_file_records(path: Path) -> list[bytes]:
    """The records of a .wandb file: a 7-byte header (":W&B", magic, version), then LevelDB-log blocks of 32 KiB
    whose records (crc32c, length, type: full 1, first 2, middle 3, last 4) may span blocks."""
    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B", path
    pos, parts, records = 7, [], []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            pos += left
            continue
        parts.append(data[pos + 7:pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):
            records.append(b"".join(parts))
            parts = []
    return records


def _wandb_run(folder: Path) -> tuple[dict, list[dict]]:
    """(run record: id, name, project, config; history rows) of the one offline run in ``folder``/wandb."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = folder.glob("wandb/offline-run-*/run-*.wandb")
    run, rows = {}, []
    for data in _wandb_file_records(path):
        record = pb.Record()
        record.ParseFromString(data)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = {"id": record.run.run_id, "name": record.run.display_name, "project": record.run.project,
                   "config": {u.key: json.loads(u.value_json) for u in record.run.config.update}}
        elif kind == "history":
            rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item})
    return run, rows


@pytest.fixture
def offline(monkeypatch):
    pytest.importorskip("wandb", reason="wandb is not installed: pip install wandb (the `test` extra has it)")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")


def _write(out: Path, records: list[dict], start_step=None, enabled=True, name="table1/convit_small"):
    from convit_scale.metrics import WandbOptions

    opts = WandbOptions("convit-scale-test", None, name, "auto", {"model": {"name": "convit_nano"}})
    writer = MetricsWriter(out, enabled, tensorboard=False, start_step=start_step, wandb=opts)
    for r in records:
        writer.write(r)
    writer.close()


def _expected(run_dir: Path) -> dict[int, dict]:
    """metrics.jsonl's numbers by step, as W&B should hold them (nulls left out)."""
    by_step: dict[int, dict] = {}
    for r in read_records(run_dir):
        by_step.setdefault(r["step"], {}).update({k: v for k, v in scalars(r).items() if v is not None})
    return by_step


def test_wandb_offline_holds_what_metrics_jsonl_holds(offline, tmp_path, capsys):
    out = tmp_path / "runs" / "table1" / "convit_small"
    out.mkdir(parents=True)
    _write(out, _records(range(1, 7)))
    assert "[convit-scale] W&B offline (WANDB_MODE in the environment): run table1/convit_small" in \
        capsys.readouterr().out
    run, rows = _wandb_run(out)
    assert run["name"] == "table1/convit_small" and run["project"] == "convit-scale-test"
    assert run["config"]["model"] == {"name": "convit_nano"}
    assert run["id"] == (out / WANDB_ID_FILE).read_text().strip()
    got: dict[int, dict] = {}
    for row in rows:
        got.setdefault(row["_step"], {}).update({k: v for k, v in row.items() if not k.startswith("_")})
    expected = _expected(out)
    assert got == expected
    assert read_records(out)[1]["loss"] is None and "train/loss" not in got[2]  # the non-finite loss
    assert got[3]["eval/top1"] == 30.0 and got[6]["train/peak_mem_mb/1"] == 66.0


def test_a_resumed_run_continues_its_wandb_run_and_a_fresh_one_starts_another(offline, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    _write(out, _records(range(1, 5)))
    first = (out / WANDB_ID_FILE).read_text()
    _write(out, _records(range(3, 7)), start_step=2)  # resumed from step 2's checkpoint
    assert (out / WANDB_ID_FILE).read_text() == first
    assert [r["step"] for r in read_records(out, "train")] == list(range(1, 7))
    _write(out, _records(range(1, 3)), start_step=0)  # a fresh start in the same folder: a new W&B run
    assert (out / WANDB_ID_FILE).read_text() != first


def test_only_rank_0_writes(offline, tmp_path):
    _write(tmp_path, _records(range(1, 3)), enabled=False)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_a_training_run_logs_to_wandb_what_it_writes_to_metrics_jsonl(offline, fm_tree, tmp_path):
    """The engine's writer built from the recipe (log.wandb): one process, a few steps and an evaluation."""
    from support import run_cli, tiny_recipe

    out = tmp_path / "runs" / "tiny"
    r = tiny_recipe(tmp_path / "r.yaml", "imagefolder", fm_tree, out, parallel={"strategy": "none"},
                    schedule={"max_steps": 3}, log={"every_steps": 1, "progress": False, "wandb": True,
                                                                  "wandb_project": "convit-scale-test"})
    res = run_cli("train", "--recipe", str(r), env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    assert res.returncode == 0, res.stderr[-3000:]
    assert "[convit-scale] W&B offline (WANDB_MODE in the environment): run tiny" in res.stdout
    run, rows = _wandb_run(out)
    assert run["name"] == "tiny" and run["config"]["model"]["name"] == "convit_nano"
    got: dict[int, dict] = {}
    for row in rows:
        got.setdefault(row["_step"], {}).update({k: v for k, v in row.items() if not k.startswith("_")})
    assert got == _expected(out) and "train/loss" in got[1] and "eval/top1" in got[3]


def test_a_line_torn_by_a_crash_does_not_block_reading_or_resuming(tmp_path):
    from convit_scale.metrics import truncate_after

    (tmp_path / "metrics.jsonl").write_text('{"kind": "train", "step": 1}\n{"kind": "train", "step": 2}\n{"kind": "tr')
    assert [r["step"] for r in read_records(tmp_path, "train")] == [1, 2]
    truncate_after(tmp_path, 1)
    assert [r["step"] for r in read_records(tmp_path)] == [1]
