"""Mirrors: each record's numbers also reach wandb (offline run, read back from its .wandb file) and
TensorBoard (read back with tensorboard's EventAccumulator), one key per section and group, batch balance as
shares; telemetry.jsonl stays the source of truth and a failing mirror is isolated like a metric error."""

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


def train(tmp_path, steps=4, labels=None, **overrides):
    """`labels(step)`: the batch's labels (6 of them, classes 0-2); random 0/1 by default."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 3))
    optimizer = torch.optim.SGD([{"params": model[0].parameters(), "name": "body"},
                                 {"params": model[2].parameters(), "name": "head"}], lr=0.1)
    config = dict(output_dir=str(tmp_path / "run"), collect_every_n=2, strict=True, alerts=False,
                  track_system=False)
    telemetry = TrainingTelemetry(TelemetryConfig(**{**config, **overrides}))
    for step in range(steps):
        optimizer.zero_grad()
        x = torch.randn(6, 4)
        y = labels(step) if labels else torch.randint(0, 2, (6,))
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        telemetry.on_batch_end(model, optimizer, step, 0, batch=(x, y), loss=loss)
    telemetry.close()
    return [json.loads(line) for line in open(tmp_path / "run" / "telemetry.jsonl")]


def test_flatten_scalars_keeps_one_key_per_section_and_group():
    record = {"schema": 1, "step": 3, "batch_idx": 2, "epoch": 0, "start": 1, "timestamp": "t", "loss": 0.5,
              "reference_step": 2, "gradient_norm": {"overall": 1.0, "head": None, "layer_1": 0.5},
              "holdout_logits": {"predictions": [1, 0], "accuracy": 0.5, "num_classes": 2},
              "batch_stats": {"batch_size": 4, "label_key": "y", "counts": {"0": 3, "2": 1}, "y_0_pct": 75.0,
                              "y_2_pct": 25.0, "fingerprint": [1.0, 2.0]},
              "layer_stats": {"0": {"grad_norm": 1.0}}, "grad_profile": {"0": 1.0},
              "activations": {"1": {"units": 3, "dead": 0.0}},
              "param_change": {"l2": 0.1, "per_layer": {"0": {"l2": 0.1}}, "sparsity": {"1e-08": 0.2}},
              "lora": {"modules": 4, "adapter_norm": {"overall": 2.0, "layer_0": 1.0}, "b_zero_fraction": 0.0},
              "custom": {"mine": {"layer_stats": 7}}, "nonfinite": ["x"], "flag": True}
    assert flatten_scalars(record, classes={"1": None}) == {
        "telemetry/epoch": 0.0, "telemetry/loss": 0.5,
        "telemetry/gradient_norm/overall": 1.0, "telemetry/gradient_norm/layer_1": 0.5,   # a group, not a layer row
        "telemetry/holdout_logits/accuracy": 0.5,
        "telemetry/param_change/l2": 0.1, "telemetry/param_change/sparsity/1e-08": 0.2,
        "telemetry/lora/adapter_norm/overall": 2.0, "telemetry/lora/b_zero_fraction": 0.0,
        "telemetry/custom/mine/layer_stats": 7.0,   # a custom metric goes out as named
        "telemetry/batch_share/0": 0.75, "telemetry/batch_share/1": 0.0, "telemetry/batch_share/2": 0.25}
    lm = {"step": 1, "batch_stats": {"batch_size": 2, "tokens": 20, "label_share": 0.5, "padding_share": 0.1}}
    assert flatten_scalars(lm) == {"telemetry/batch_stats/label_share": 0.5, "telemetry/batch_stats/padding_share": 0.1}


def expected_mirror(records):
    """{key: [(step, value)]}: flatten_scalars for the sections; batch shares from the JSONL's counts, every
    class seen so far at every record (0 where the batch lacks it)."""
    expected, seen = {}, []
    for record in records:
        flat = {k: v for k, v in flatten_scalars(record).items() if "/batch_share/" not in k}
        counts = record["batch_stats"]["counts"]
        seen += [c for c in counts if c not in seen]
        for c in seen:
            flat[f"telemetry/batch_share/{c}"] = counts.get(c, 0) / record["batch_stats"]["batch_size"]
        for key, value in flat.items():
            expected.setdefault(key, []).append((record["step"], value))
    return expected


def rare_class(step):
    # Class 2 only in the first batch: its share must still be sent, at 0, with every later record.
    return torch.tensor([0, 1, 2, 0, 1, 1]) if step == 0 else torch.tensor([0, 1, 0, 0, 1, 1])


def test_tensorboard_mirror_matches_the_jsonl(tmp_path):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator",
                                            reason="tensorboard is not installed")
    records = train(tmp_path, mirror=["tensorboard"], steps=6, labels=rare_class)
    accumulator = event_accumulator.EventAccumulator(str(tmp_path / "run" / "tb"))
    accumulator.Reload()
    expected = expected_mirror(records)
    assert "telemetry/gradient_norm/head" in expected and "telemetry/weight_delta/body" in expected
    assert [v for _, v in expected["telemetry/batch_share/2"]] == [1 / 6, 0.0, 0.0]
    assert not [k for k in expected if "count" in k or "num_classes" in k or k.endswith("_pct")]
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
        records = train(tmp_path, mirror=["wandb"], steps=6, labels=rare_class)
    finally:
        run.finish()
    (path,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    for _ in range(100):  # wandb's service may still be flushing the file when finish() returns
        rows = [row for row in read_wandb_history(path) if "telemetry/step" in row]
        if len(rows) >= len(records):
            break
        time.sleep(0.1)
    assert [row["telemetry/step"] for row in rows] == [r["step"] for r in records] == [1, 3, 5]
    expected = expected_mirror(records)
    assert "telemetry/gradient_norm/head" in expected and "telemetry/batch_share/2" in expected
    for row in rows:
        here = {key: v for key, points in expected.items() for step, v in points if step == row["telemetry/step"]}
        assert set(row) - {"telemetry/step", "_step", "_runtime", "_timestamp"} == set(here)
        for key, value in here.items():
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
