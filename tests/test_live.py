"""Following a run while it trains: run.json marks where each start ended, and `analyze_telemetry.py --watch`
waits for a run that does not exist yet, prints a line per record and stops by itself when the run closes."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from telemetry import TelemetryConfig, TrainingTelemetry  # noqa: E402


def steps(telemetry, model, n, start=0):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(start, start + n):
        optimizer.zero_grad()
        x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        telemetry.on_batch_end(model, optimizer, i, 0, batch=(x, y), loss=loss)


def run_json(path):
    return json.loads((path / "run.json").read_text())


def test_close_records_the_end_of_each_start(tmp_path):
    run = tmp_path / "run"
    model = torch.nn.Linear(4, 2)
    first = TrainingTelemetry(TelemetryConfig(output_dir=str(run), collect_every_n=1))
    steps(first, model, 2)
    assert "ends" not in run_json(run)   # still running
    first.close()
    first.close()                        # a second close keeps the first end
    info = run_json(run)
    assert len(info["ends"]) == len(info["starts"]) == 1 and info["ends"][0] >= info["starts"][0]
    ended = info["ends"][0]
    second = TrainingTelemetry(TelemetryConfig(output_dir=str(run), collect_every_n=1))   # a resume
    steps(second, model, 2, start=2)
    info = run_json(run)
    assert len(info["starts"]) == 2 and info["ends"] == [ended]   # open again: the last start has no end
    second.close()
    assert run_json(run)["ends"][0] == ended and len(run_json(run)["ends"]) == 2


def test_a_run_moved_to_its_own_directory_ends_there(tmp_path):
    run = tmp_path / "run"
    with TrainingTelemetry(TelemetryConfig(output_dir=str(run), collect_every_n=1)) as telemetry:
        steps(telemetry, torch.nn.Linear(4, 2), 1)
    ended = run_json(run)["ends"]
    with pytest.warns(RuntimeWarning, match="another model"):
        with TrainingTelemetry(TelemetryConfig(output_dir=str(run), collect_every_n=1)) as other:
            steps(other, torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)), 1)
    assert run_json(run)["ends"] == ended and len(run_json(run)["starts"]) == 1
    moved = Path(other.output_dir)
    assert moved != run and len(run_json(moved)["ends"]) == len(run_json(moved)["starts"]) == 1
