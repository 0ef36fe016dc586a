"""Mirrors: each record's numbers also reach wandb (offline run, read back from its .wandb file) and
TensorBoard (read back with tensorboard's EventAccumulator); telemetry.jsonl stays the source of truth and
a failing mirror is isolated like a metric error."""

import glob
import json
import os
import struct
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from telemetry import TelemetryConfig, TrainingTelemetry, flatten_scalars  # noqa: E402


def train(tmp_path, steps=4, **overrides):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    optimizer = torch.optim.SGD([{"params": model[0].parameters(), "name": "body"},
                                 {"params": model[2].parameters(), "name": "head"}], lr=0.1)
    config = dict(output_dir=str(tmp_path / "run"), collect_every_n=2, strict=True, alerts=False,
                  track_system=False)
    telemetry = TrainingTelemetry(TelemetryConfig(**{**config, **overrides}))
    for step in range(steps):
        optimizer.zero_grad()
        x, y = torch.randn(6, 4), torch.randint(0, 2, (6,))
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        telemetry.on_batch_end(model, optimizer, step, 0, batch=(x, y), loss=loss)
    telemetry.close()
    return [json.loads(line) for line in open(tmp_path / "run" / "telemetry.jsonl")]


def test_flatten_scalars_keeps_numbers_only():
    record = {"schema": 1, "step": 3, "batch_idx": 2, "epoch": 0, "timestamp": "t", "loss": 0.5,
              "gradient_norm": {"overall": 1.0, "head": None}, "holdout_logits": {"predictions": [1, 0], "accuracy": 0.5},
              "batch_stats": {"label_key": "y", "counts": {"0": 3}}, "nonfinite": ["x"], "flag": True}
    assert flatten_scalars(record) == {"telemetry/epoch": 0.0, "telemetry/loss": 0.5,
                                       "telemetry/gradient_norm/overall": 1.0,
                                       "telemetry/holdout_logits/accuracy": 0.5,
                                       "telemetry/batch_stats/counts/0": 3.0}


def test_tensorboard_mirror_matches_the_jsonl(tmp_path):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator",
                                            reason="tensorboard is not installed")
    records = train(tmp_path, mirror=["tensorboard"])
    accumulator = event_accumulator.EventAccumulator(str(tmp_path / "run" / "tb"))
    accumulator.Reload()
    expected = {}
    for record in records:
        for key, value in flatten_scalars(record).items():
            expected.setdefault(key, []).append((record["step"], value))
    assert "telemetry/gradient_norm/head" in expected and "telemetry/weight_delta/body" in expected
    assert set(accumulator.Tags()["scalars"]) == set(expected)
    for key, points in expected.items():
        got = [(e.step, e.value) for e in accumulator.Scalars(key)]
        assert [s for s, _ in got] == [s for s, _ in points]
        assert all(abs(a - b) <= 1e-6 * max(abs(b), 1.0) for (_, a), (_, b) in zip(got, points)), key


def read_wandb_history(path):
    """History rows of an offline run's .wandb file: a LevelDB-style log (7-byte ':W&B' header, 32 KiB
    blocks of records with a 7-byte crc/length/type header) of wandb_internal_pb2.Record messages."""
    from wandb.proto import wandb_internal_pb2

    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    pos, rows, pending = 7, [], b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if left < 7 or (length == 0 and kind == 0):  # block padding
            pos += left
            continue
        if pos + 7 + length > len(data):  # still being written
            break
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return rows


def test_wandb_mirror_matches_the_jsonl(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb", reason="wandb is not installed")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = wandb.init(project="telemetry-test", dir=str(tmp_path))
    try:
        records = train(tmp_path, mirror=["wandb"])
    finally:
        run.finish()
    (path,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    for _ in range(100):  # wandb's service may still be flushing the file when finish() returns
        rows = [row for row in read_wandb_history(path) if "telemetry/step" in row]
        if len(rows) >= len(records):
            break
        time.sleep(0.1)
    assert [row["telemetry/step"] for row in rows] == [r["step"] for r in records] == [1, 3]
    for row, record in zip(rows, records):
        flat = flatten_scalars(record)
        assert "telemetry/gradient_norm/head" in flat
        for key, value in flat.items():
            assert abs(row[key] - value) <= 1e-9 * max(abs(value), 1.0), key


def test_wandb_mirror_without_a_run_warns_and_writes_the_jsonl(tmp_path):
    pytest.importorskip("wandb", reason="wandb is not installed")
    import wandb

    assert wandb.run is None
    with pytest.warns(RuntimeWarning, match="no active run"):
        records = train(tmp_path, mirror=["wandb"])
    assert len(records) == 2 and all("errors" not in r for r in records)


def test_a_failing_mirror_is_recorded_and_the_jsonl_still_written(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "tb").write_text("a file where the event directory should be")
    with pytest.warns(RuntimeWarning, match="tensorboard mirror failed"):
        records = train(tmp_path, mirror=["tensorboard"], strict=False)
    assert len(records) == 2 and records[0]["gradient_norm"]["overall"] > 0
    assert all("mirror_tensorboard" in r["errors"] for r in records)
    with pytest.raises(Exception):
        train(tmp_path, mirror=["tensorboard"], strict=True)


def test_unknown_mirror_is_a_config_error(tmp_path):
    with pytest.raises(ValueError, match="mirror: unknown 'mlflow'"):
        TelemetryConfig(output_dir=str(tmp_path), mirror=["mlflow"])
    assert TelemetryConfig(output_dir=str(tmp_path), mirror="wandb").mirror == ["wandb"]
