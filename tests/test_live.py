"""Following a run while it trains: run.json marks where each start ended, and `analyze_telemetry.py --watch`
waits for a run that does not exist yet, prints a line per record and stops by itself when the run closes."""

import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import analyze_telemetry as at  # noqa: E402
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


def test_watch_waits_for_the_run_follows_it_and_ends_when_it_closes(tmp_path):
    run = tmp_path / "not_yet" / "run"
    proc = subprocess.Popen([sys.executable, str(ROOT / "analyze_telemetry.py"), str(run), "--watch",
                             "--interval", "0.2", "--no-plots", "--max-seconds", "120"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()

    def wait_for(text):
        deadline = time.monotonic() + 60
        while not any(text in line for line in lines) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert any(text in line for line in lines), (text, lines, proc.poll())

    try:
        wait_for("waiting for")
        started = time.monotonic()
        telemetry = TrainingTelemetry(TelemetryConfig(output_dir=str(run), collect_every_n=1))
        telemetry.set_holdout_data((torch.randn(20, 4), torch.randint(0, 2, (20,))))
        steps(telemetry, torch.nn.Linear(4, 2), 3)
        wait_for("[run] step 3  loss")
        assert proc.poll() is None   # the run is still open: watching goes on
        telemetry.close()
        assert proc.wait(timeout=60) == 0, proc.stderr.read()
        assert time.monotonic() - started < 60   # it ended by itself, long before --max-seconds
    finally:
        proc.kill()
    reader.join(10)
    text = "".join(lines)
    for step in (1, 2, 3):
        assert re.search(rf"^\[run\] step {step}  loss \S+  holdout acc \S+  holdout loss \S+ \| ", text, re.M), text
    assert "[run] run closed at " in text and "watched 3 records" in text


def test_the_report_reloads_itself_only_while_watching(tmp_path, monkeypatch):
    run = tmp_path / "run"
    with TrainingTelemetry(TelemetryConfig(output_dir=str(run), collect_every_n=1)) as telemetry:
        steps(telemetry, torch.nn.Linear(4, 2), 2)
    monkeypatch.setattr(at, "make_plots", lambda runs, out: (out.mkdir(parents=True, exist_ok=True), ([], []))[1])
    reports, write_report = [], at.write_report

    def keep_text(*args, **kwargs):
        path = write_report(*args, **kwargs)
        reports.append(path.read_text())
        return path

    monkeypatch.setattr(at, "write_report", keep_text)
    args = at._parser().parse_args([str(run), "--watch", "--interval", "2", "--redraw", "7"])
    watch = at.Watch([at.new_run(run)], args, want_plots=True)
    assert watch.poll()            # a closed run: one look, drawn live, and done
    assert watch.finish() == 0     # then drawn once more, for good
    assert len(reports) == 2
    assert "<meta http-equiv='refresh' content='7'>" in reports[0] and "Live: reloads every 7 s" in reports[0]
    assert "http-equiv" not in reports[1] and "Live:" not in reports[1]
