"""The analyzer on damaged files: mutated copies of a real run must never end in a traceback.

A tiny model trains for a few collections with the real telemetry.py; each case damages its
telemetry.jsonl and/or run.json one way (bytes flipped, cut short, nesting thousands deep, numbers out of
float range, wrong types at random paths, unhashable values, lone surrogates, lines that are not
objects) and runs the analyzer's text, --json, --check and --csv modes on it. The exit status must be 0 or
1, and no check may have failed (the analyzer turns a check that raises into a notice; on these files
that would be a bug, so it fails the test).
"""

import contextlib
import io
import json
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import analyze_telemetry as at  # noqa: E402

CASES = 360
SEED = 20261123
CHECK_FAILED = at.CHECK_FAILED


@pytest.fixture(scope="module")
def real_run(tmp_path_factory):
    """(record lines, run.json text) of a real run: 16 collections of a 3-class MLP, layer stats on."""
    from telemetry import TelemetryConfig, TrainingTelemetry

    out = tmp_path_factory.mktemp("real")
    gen = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(96, 6, generator=gen)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    tel = TrainingTelemetry(TelemetryConfig(output_dir=str(out), collect_every_n=1, holdout_size=12,
                                            track_layer_stats=True, track_param_change=True))
    tel.set_holdout_data((x[:12], y[:12]))
    for i in range(1, 17):
        lo = 12 + (i % 5) * 16
        xb, yb = x[lo:lo + 16], y[lo:lo + 16]
        logits = model(xb)
        loss = F.cross_entropy(logits, yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
        acc = (logits.argmax(1) == yb).float().mean().item()
        tel.on_batch_end(model, opt, i, 0, batch={"x": xb, "labels": yb}, loss=loss.item(), train_acc=acc)
    tel.close()
    lines = (out / "telemetry.jsonl").read_text().splitlines()
    assert len(lines) == 16
    return lines, (out / "run.json").read_text()


# ---- mutations -----------------------------------------------------------------------------------

def paths_of(node, prefix=()):
    """Every key/index path inside a JSON value."""
    out = [prefix]
    if isinstance(node, dict):
        for k, v in node.items():
            out += paths_of(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += paths_of(v, prefix + (i,))
    return out


def set_at(node, path, value):
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = value


SURROGATE = "\ud800"
ODD_VALUES = ["x", "", SURROGATE, "a" + SURROGATE + "b", [], [1, "2", None], {}, {"overall": "x"}, {SURROGATE: 1},
              True, False, None, 0, -1, 2 ** 70, 3.5, -1e308, 1e-320, [[[[]]]], [{"code": [1]}], {"": {}}]
HUGE = ["1e400", "-1e400", "1" * 400, "-" + "9" * 400, "1" * 400 + ".5", "1e-400", "1" * 5000]


def deep(rng):
    n = rng.choice([50, 400, 990, 3000, 100000])
    return rng.choice(["[" * n + "]" * n, '{"a":' * n + "1" + "}" * n, "[" * n + "1" + "]" * n])


def random_path(rng, rec: dict):
    """A path inside a random top-level field (so that small sections are hit as often as the logits)."""
    key = rng.choice(list(rec))
    return rng.choice(paths_of(rec[key], (key,)))


def mutate_record(rng, rec: dict) -> str:
    """One record as a line, damaged at a random place; values json cannot write go in as raw text."""
    kind = rng.choice(["type", "type", "type", "unhashable", "deep", "huge", "surrogate_key", "drop"])
    path = random_path(rng, rec)
    if kind == "type":
        set_at(rec, path, rng.choice(ODD_VALUES))
    elif kind == "unhashable":
        target = rng.choice([("schema",), ("step",), ("holdout_logits", "kind"), ("batch_stats", "label_key"),
                             ("holdout_logits", "labels", 0), ("holdout_logits", "predictions", 0),
                             ("nonfinite",), ("alerts",), ("errors",), ("start",)])
        value = rng.choice([[1], {"a": 1}, [[]], [{"code": [1], "group": {}, "severity": []}]])
        try:
            set_at(rec, target, value)
        except (KeyError, IndexError, TypeError):
            rec[target[0]] = value
    elif kind == "drop":
        parent = rec
        for p in path[:-1]:
            parent = parent[p]
        del parent[path[-1]]
    else:
        set_at(rec, path, "\x00RAW\x00")
        raw = {"deep": deep(rng), "huge": rng.choice(HUGE),
               "surrogate_key": '{"\\udc00": 1, "a\\ud800b": "\\udfff"}'}[kind]
        return json.dumps(rec).replace('"\\u0000RAW\\u0000"', raw)
    return json.dumps(rec)


def mutate_bytes(rng, data: bytes) -> bytes:
    kind = rng.choice(["flip", "flip", "truncate", "garbage_tail", "non_object", "invalid_utf8", "splice"])
    b = bytearray(data)
    if kind == "flip":
        for _ in range(rng.randint(1, 12)):
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
    elif kind == "truncate":
        b = b[:rng.randrange(len(b))]
    elif kind == "garbage_tail":
        b += rng.choice([b"\x00" * 300, b"garbage", b"{\"schema\":1,", b"\n\n  \n", b"\xff\xfe", b"]]]\n"])
    elif kind == "non_object":
        lines = bytes(b).split(b"\n")
        lines.insert(rng.randrange(len(lines)), rng.choice([b"[1,2]", b"3", b'"x"', b"null", b"true", b"[]"]))
        b = bytearray(b"\n".join(lines))
    elif kind == "invalid_utf8":
        i = rng.randrange(len(b))
        b[i:i] = rng.choice([b"\xed\xa0\x80", b"\xff", b"\xc3"])
    else:   # a line of another run glued into this one
        cut = rng.randrange(len(b))
        b = b[:cut] + bytes(data[rng.randrange(len(data)):])
    return bytes(b)


def mutate_meta(rng, meta_text: str) -> str:
    meta = json.loads(meta_text)
    kind = rng.choice(["starts", "starts", "type", "unparseable", "not_object", "deep", "huge", "empty"])
    if kind == "starts":
        meta["starts"] = rng.choice([5, "x", None, {}, [1, 2], [None], ["2026-11-23T16:58:17", [1]],
                                     [SURROGATE], ["not a time"], []])
    elif kind == "type":
        path = rng.choice([p for p in paths_of(meta) if p])
        set_at(meta, path, rng.choice(ODD_VALUES))
        for key in ("parameters", "holdout", "groups"):
            if rng.random() < 0.3:
                meta[key] = rng.choice(ODD_VALUES)
    elif kind == "unparseable":
        return meta_text[:rng.randrange(len(meta_text))]
    elif kind == "not_object":
        return rng.choice(["[]", "5", '"run"', "null"])
    elif kind == "deep":
        return '{"starts": ' + deep(rng) + "}"
    elif kind == "huge":
        return '{"parameters": {"trainable": ' + rng.choice(HUGE) + '}, "holdout": {"examples": '\
               + rng.choice(HUGE) + "}}"
    else:
        return ""
    return json.dumps(meta)


def with_rare_sections(lines):
    """The real records, plus the sections a healthy run seldom writes, in telemetry.py's format, so
    that they are damaged too: restart markers, an alert, a metric error, a non-finite value."""
    recs = [json.loads(line) for line in lines]
    recs[0]["start"] = 0
    recs[5]["alerts"] = [{"code": "loss_spike", "severity": "warning", "message": "loss 9x its median",
                          "group": None}]
    recs[6]["errors"] = {"batch_stats": "TypeError: unsupported batch type list"}
    recs[7]["gradient_norm"]["group_0"] = None
    recs[7]["nonfinite"] = ["gradient_norm.group_0"]
    recs[10]["start"] = 1   # a resume
    return recs


def as_regression(recs):
    """The records with their holdout in the regression format (predicted class index as the output)."""
    for r in recs:
        h = r["holdout_logits"]
        pred, target = [float(p) for p in h["predictions"]], [float(t) for t in h["labels"]]
        sq = [(p - t) ** 2 for p, t in zip(pred, target)]
        r["holdout_logits"] = {"kind": "regression", "outputs": 1, "predictions": pred, "targets": target,
                               "squared_error": sq, "abs_error": [abs(p - t) for p, t in zip(pred, target)],
                               "loss": sum(sq) / len(sq), "mae": sum(abs(p - t) for p, t in zip(pred, target)) / len(sq)}
    return recs


def damaged_run(rng, lines, meta_text, path: Path):
    """Write one damaged copy of the real run to path: records, bytes and/or run.json mutated."""
    recs = with_rare_sections(lines)
    if rng.random() < 0.2:
        recs = as_regression(recs)
    out = [json.dumps(r) for r in recs]
    if rng.random() < 0.25:   # the same damage in every record, so checks that need many records see it
        where = random_path(rng, recs[0])
        value = rng.choice(ODD_VALUES)
        for i, r in enumerate(recs):
            with contextlib.suppress(KeyError, IndexError, TypeError):
                set_at(r, where, value)
                out[i] = json.dumps(r)
    for i in rng.sample(range(len(out)), rng.randint(1, 3)):
        out[i] = mutate_record(rng, json.loads(out[i]))
    data = ("\n".join(out) + "\n").encode("utf-8", "surrogatepass")
    if rng.random() < 0.35:
        data = mutate_bytes(rng, data)
    path.mkdir(parents=True, exist_ok=True)
    (path / "telemetry.jsonl").write_bytes(data)
    meta = mutate_meta(rng, meta_text) if rng.random() < 0.4 else meta_text
    (path / "run.json").write_bytes(meta.encode("utf-8", "surrogatepass"))


# ---- running -------------------------------------------------------------------------------------

def run_main(argv):
    """(exit status, stdout, stderr) of main(argv) in this process, with a strict UTF-8 stdout as a
    terminal has; an exception is returned as its traceback text instead of an exit status."""
    out, err = io.BytesIO(), io.BytesIO()
    out_t = io.TextIOWrapper(out, encoding="utf-8", errors="strict")
    err_t = io.TextIOWrapper(err, encoding="utf-8", errors="backslashreplace")
    with contextlib.redirect_stdout(out_t), contextlib.redirect_stderr(err_t):
        try:
            rc = at.main(argv)
        except SystemExit as exc:
            rc = exc.code
        except BaseException:
            import traceback
            rc = "Traceback:\n" + traceback.format_exc()
    out_t.flush()
    err_t.flush()
    return rc, out.getvalue().decode("utf-8", "replace"), err.getvalue().decode("utf-8", "replace")


MODES = (["--no-plots"], ["--json"], ["--check"], ["--csv", "{dir}/out.csv"])


def test_fuzzed_runs_never_crash(real_run, tmp_path):
    lines, meta_text = real_run
    rng = random.Random(SEED)
    failures, statuses = [], {}
    started = time.monotonic()
    for case in range(CASES):
        path = tmp_path / f"c{case}"
        damaged_run(rng, lines, meta_text, path)
        argv = [str(path)] + [a.format(dir=path) for a in MODES[case % len(MODES)]]
        rc, stdout, stderr = run_main(argv)
        statuses[rc if rc in (0, 1, 2) else "crash"] = statuses.get(rc if rc in (0, 1, 2) else "crash", 0) + 1
        if rc not in (0, 1) or "Traceback" in stderr or CHECK_FAILED in stdout + stderr:
            failures.append(f"case {case} {argv[1:]}: rc={str(rc)[-1500:]}\n{stderr[-500:]}")
        if argv[1] == "--json" and rc in (0, 1):
            json.loads(stdout)   # still one valid JSON document
    elapsed = time.monotonic() - started
    print(f"{CASES} damaged runs in {elapsed:.1f}s: exit statuses {statuses}")
    assert not failures, f"{len(failures)} of {CASES} failed:\n" + "\n".join(failures[:5])
    assert elapsed < 30, elapsed


def test_damaged_runs_through_the_command_line(real_run, tmp_path):
    """A few damaged runs through the script itself, plots included: no traceback on stderr."""
    lines, meta_text = real_run
    rng = random.Random(SEED + 1)
    for case in range(2):
        path = tmp_path / f"c{case}"
        damaged_run(rng, lines, meta_text, path)
        flags = [["--out", str(path / "plots"), "--plots", "--csv", str(path / "x.csv")], ["--json", "--check"]][case]
        proc = subprocess.run([sys.executable, str(ROOT / "analyze_telemetry.py"), str(path), *flags],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode in (0, 1) and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert (tmp_path / "c0" / "plots" / "report.html").is_file() and (tmp_path / "c0" / "x.csv").is_file()


# ---- damage, case by case ------------------------------------------------------------------------

def test_the_undamaged_run_has_no_notices(real_run, tmp_path):
    lines, meta_text = real_run
    path = tmp_path / "run"
    path.mkdir()
    (path / "telemetry.jsonl").write_text("\n".join(lines) + "\n")
    (path / "run.json").write_text(meta_text)
    run = at.load_run(path, progress=False)
    at.diagnose(run)
    assert len(run.records) == 16 and run.notices == []


def test_each_bad_line_is_a_notice_and_the_rest_is_analyzed(real_run, tmp_path):
    lines, meta_text = real_run
    recs = [json.loads(line) for line in lines]
    out = [json.dumps(r) for r in recs]
    out[1] = '{"schema": 1, "step": ' + "[" * 5000 + "]" * 5000 + "}"   # too deep for any JSON parser
    out[3] = out[3].replace('"loss":', '"loss": 1e400, "was_loss":', 1)   # parses as inf: out of float range
    out[5] = json.dumps({**recs[5], "schema": [1]})                       # unhashable
    out[7] = json.dumps({**recs[7], "gradient_norm": [1, 2]})             # a list where an object belongs
    out[9] = json.dumps({**recs[9], "step": "ten"})                       # a string where a number belongs
    out.insert(11, "[1, 2]")                                              # not an object
    path = tmp_path / "run"
    path.mkdir()
    (path / "telemetry.jsonl").write_bytes(("\n".join(out) + "\n").encode() + b"\x00" * 64)
    (path / "run.json").write_text(json.dumps({**json.loads(meta_text), "starts": 5}))
    run = at.load_run(path, progress=False)
    notes = "\n".join(run.notices)
    assert "line 2: malformed record (nested too deeply); skipped" in notes
    assert "line 12: malformed record (a JSON list, not an object); skipped" in notes
    assert "line 8: gradient_norm is a list, not an object; left out" in notes
    assert "line 10: step is a string, not an integer" in notes
    assert "1 record(s) have schema (a list)" in notes
    assert "line 18: 64 bytes of garbage after the last record" in notes
    assert "run.json: starts is an integer, not a list; left out" in notes
    assert len(run.records) == 15   # 16 records, one too deep to read
    loss = at.column(run, "loss")
    kept = [r for i, r in enumerate(recs) if i != 1]
    assert np.isnan(loss[2]) and loss[4] == kept[4]["loss"] and loss[-1] == kept[-1]["loss"]
    assert at.steps(run)[8] == kept[7]["step"] + 1   # "ten" numbered after the record before it
    rc, stdout, stderr = run_main([str(path), "--json"])
    assert rc in (0, 1) and json.loads(stdout)["summary"]["records"] == 15


def test_run_json_damage_is_a_notice(real_run, tmp_path):
    lines, meta_text = real_run
    path = tmp_path / "run"
    path.mkdir()
    (path / "telemetry.jsonl").write_text("\n".join(lines) + "\n")
    for text, notice in (('{"starts": ' + "[" * 3000 + "]" * 3000 + "}", "run.json unreadable (maximum recursion"),
                         ("[1, 2]", "run.json holds a list, not an object"),
                         ('{"parameters": {"trainable": "many"}}', "run.json: parameters.trainable is a string"),
                         ('{"holdout": {"examples": ' + "9" * 400 + "}}", "run.json: holdout.examples is an integer beyond 64"),
                         ('{"starts": ["2026-11-23T16:58:17", 3]}', "run.json: starts holds something other")):
        (path / "run.json").write_text(text)
        run = at.load_run(path, progress=False)
        at.summarize(run, at.diagnose(run))
        assert any(n.startswith(notice) for n in run.notices), (notice, run.notices)
        assert len(run.records) == 16 and not any(at.CHECK_FAILED in n for n in run.notices)


def test_lone_surrogates_reach_csv_and_terminal_escaped(real_run, tmp_path):
    lines, meta_text = real_run
    recs = [json.loads(line) for line in lines]
    for r in recs:
        r["gradient_norm"]["odd\udc80group"] = 0.5
    recs[4]["errors"] = {"batch_stats": "ValueError: label \ud800"}
    path = tmp_path / "run"
    path.mkdir()
    (path / "telemetry.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")   # \u escapes: valid JSON
    (path / "run.json").write_text(meta_text)
    rc, _, _ = run_main([str(path), "--csv", str(tmp_path / "out.csv")])
    assert rc == 0
    header = (tmp_path / "out.csv").read_text(encoding="utf-8").splitlines()[0]
    assert "gradient_norm.odd\\udc80group" in header
    proc = subprocess.run([sys.executable, str(ROOT / "analyze_telemetry.py"), str(path), "--no-plots"],
                          capture_output=True, timeout=120)
    assert proc.returncode == 0 and b"Traceback" not in proc.stderr
    assert b"label \\ud800" in proc.stdout   # the metric_errors finding, escaped
    run = at.load_run(path, progress=False)
    assert at.plot_gradient_norm([run], tmp_path / "g.png") is None   # drawn, the legend escaped


def test_a_check_that_raises_costs_only_its_own_findings(real_run, tmp_path, monkeypatch):
    lines, meta_text = real_run
    path = tmp_path / "run"
    path.mkdir()
    (path / "telemetry.jsonl").write_text("\n".join(lines) + "\n")
    (path / "run.json").write_text(meta_text)
    expected = [f.code for f in at.diagnose(at.load_run(path, progress=False))]
    assert expected

    def check_broken(run):
        raise KeyError("no such thing")
    monkeypatch.setattr(at, "CHECKS", (check_broken,) + at.CHECKS)
    run = at.load_run(path, progress=False)
    assert [f.code for f in at.diagnose(run)] == expected
    assert run.notices == [f"{at.CHECK_FAILED} check_broken (KeyError: 'no such thing'); its findings are left out"]
