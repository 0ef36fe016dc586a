#!/usr/bin/env python3
"""Read a training-telemetry run directory and explain it.

A run directory holds `telemetry.jsonl` (one strict-JSON record per line) and `run.json`, as written
by telemetry.py (the record format is the contract; this reader does not import telemetry.py).

    python analyze_telemetry.py RUN_DIR                 # summary + findings, PNG plots + report.html
    python analyze_telemetry.py RUN_A RUN_B             # the same plots overlaid + a side-by-side table
    python analyze_telemetry.py RUN_DIR --json          # summary and findings as JSON on stdout
    python analyze_telemetry.py RUN_DIR --check         # exit 1 when a finding is critical (CI smoke test)
    python analyze_telemetry.py RUN_DIR --csv run.csv   # one flat row per record
    python analyze_telemetry.py RUN_DIR --watch         # follow a run while it trains; ends when it closes

Plots and the report go to RUN_DIR/analysis/ (several runs: FIRST_RUN/analysis/compare-A-vs-B/) or --out.
Plots need matplotlib, everything else numpy: `pip install numpy matplotlib`.
Pandas users: `from analyze_telemetry import to_dataframe; df = to_dataframe("runs/exp1")` (or a list of
run directories: one frame, a `run` column tells them apart).

A run resumed by another process (records carry `"start": k`, an index into run.json's `starts`) or with
another run appended (the step goes back) is read in segments: loss spikes, gradient growth, jumps and
shrinking, and forgetting events are judged within a segment, and the duration leaves out the gaps.
Damaged files never stop the analysis: what cannot be read is a notice, naming the line.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import csv
import errno
import gc
import hashlib
import html
import io
import json
import math
import os
import re
import shutil
import stat
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path

INSTALL_HINT = "pip install numpy matplotlib"


class _Missing:
    """Stands in for a package that is not installed: its first use raises an ImportError that says how
    to install it (main() checks first and says it in one line)."""

    def __init__(self, name: str):
        self.name = name

    def __getattr__(self, attr):
        raise ImportError(f"analyze_telemetry needs {self.name}: {INSTALL_HINT}")


try:
    import numpy as np
except ImportError:
    np = _Missing("numpy")

SCHEMA_VERSION = 1
NOT_IN_OPTIMIZER = "not_in_optimizer"   # telemetry.py's group for trainable tensors outside the optimizer
SEVERITIES = ("info", "warning", "critical")
RECORD_FILE = "telemetry.jsonl"
RUN_FILE = "run.json"


# ---- Loading ----------------------------------------------------------------------------------------

@dataclass
class Run:
    """One run directory as read so far. `offset`/`pending` let --watch read only what was appended."""
    path: Path
    name: str
    meta: dict = field(default_factory=dict)
    records: list = field(default_factory=list)
    notices: list = field(default_factory=list)
    offset: int = 0              # bytes of telemetry.jsonl consumed
    lines: int = 0               # complete lines consumed
    pending: bytes = b""         # an incomplete last line, kept until its newline arrives
    other_schemas: dict = field(default_factory=dict)
    cache: dict = field(default_factory=dict)
    # Where a process started again on this run directory, or another run was appended: one dict per
    # restart, {"step", "start" (index into run.json's starts; None when only the step went back),
    # "index" (its first record)}. Series findings never compare across one (see segment_ids).
    restarts: list = field(default_factory=list)


def _reject_constant(name):
    # json accepts NaN/Infinity by default; the contract says they never appear, so a line holding
    # one is malformed rather than silently turning into a float('nan').
    raise ValueError(f"{name} is not valid JSON")


_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


def resolve_run_dir(path) -> Path:
    """Accept the run directory or the telemetry.jsonl inside it (another file is no run directory, and is
    named as such, not taken for the directory it is in)."""
    p = Path(path)
    return p.parent if p.name == RECORD_FILE else p


def new_run(path) -> Run:
    path = resolve_run_dir(path)
    return Run(path=path, name=path.resolve().name or str(path))


def load_run(path, progress: bool = True) -> Run:
    """Read a whole run directory. Bad lines become notices, never exceptions."""
    run = new_run(path)
    records_file = run.path / RECORD_FILE
    if not records_file.is_file():
        raise FileNotFoundError(f"no {RECORD_FILE} in {run.path}")
    read_new_records(run, final=True, progress=progress)
    return run


# The run.json fields this reader uses and the type each must have. A field of another type is left
# out (with a notice) and the rest of run.json is still used.
META_FIELDS = ((("starts",), list), (("groups",), dict), (("parameters", "trainable"), int),
               (("holdout", "examples"), int))


def read_meta(run: Run) -> None:
    meta_file = run.path / RUN_FILE
    if not meta_file.is_file():
        return
    try:
        meta = _DECODER.decode(meta_file.read_text(encoding="utf-8"))
    except (ValueError, OSError, RecursionError) as exc:
        run.meta = {}
        _notice(run, f"{RUN_FILE} unreadable ({_first_line(exc)}); going on without run metadata")
        return
    if not isinstance(meta, dict):
        run.meta = {}
        _notice(run, f"{RUN_FILE} holds {_kind(meta)}, not an object; going on without run metadata")
        return
    for path, kind in META_FIELDS:
        value = _get(meta, path)
        if value is not None and not _has_type(value, kind):
            _notice(run, f"{RUN_FILE}: {'.'.join(path)} is {_kind(value)}, not {_kind(kind())}; left out")
            del _get(meta, path[:-1])[path[-1]]
    starts = meta.get("starts")
    if starts is not None and not all(isinstance(t, str) for t in starts):
        _notice(run, f"{RUN_FILE}: starts holds something other than timestamps; left out")
        del meta["starts"]
    run.meta = meta


def _why_no_records(run: Run) -> str:
    """Why a run that has run.json has no records, from the optimizer steps telemetry counted at close()."""
    read_meta(run)
    if run.meta.get("steps") != 0 or not _has_type(run.meta.get("steps"), int):
        return ""
    return (f": telemetry counted no optimizer step ({RUN_FILE}: steps 0). It collects right after a step: call "
            "on_batch_end after optimizer.step(), with the optimizer that steps")


def _has_type(value, kind) -> bool:
    """isinstance for JSON values, where a boolean is no number and an integer must fit in 64 bits."""
    if kind is int:
        return type(value) is int and -2 ** 63 <= value < 2 ** 63
    return isinstance(value, kind)


def _kind(value) -> str:
    """A JSON value's type in words, for notices: never the value itself, which may be huge or deep."""
    if type(value) is int and not -2 ** 63 <= value < 2 ** 63:
        return "an integer beyond 64 bits"
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null",
             int: "an integer", float: "a number"}
    return names.get(type(value), type(value).__name__)


def _text(value, limit: int = 200) -> str:
    """A value from a record as a short, printable string (a non-string one by its type only)."""
    if isinstance(value, str):
        return value if len(value) <= limit else value[:limit] + "..."
    if isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) < 1e18:
        return repr(value)
    return f"({_kind(value)})"


def _first_line(exc: BaseException) -> str:
    return str(exc).split("\n")[0][:120]


@contextlib.contextmanager
def gc_paused():
    """Millions of small dicts/lists from a big run make the cyclic GC rescan them over and over
    (records hold no cycles, so it finds nothing); pausing it keeps loading and diagnosis linear."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def read_new_records(run: Run, final: bool, progress: bool = False) -> int:
    """Append the records written since the last call; returns how many were added.

    final=False (watching) keeps an unterminated last line for later, since the writer may be in the
    middle of it; final=True treats it as torn if it does not parse.
    """
    read_meta(run)
    records_file = run.path / RECORD_FILE
    try:
        size = records_file.stat().st_size
    except OSError:
        return 0
    if size < run.offset:   # the file was replaced: start over
        run.records, run.offset, run.lines, run.pending, run.cache, run.restarts = [], 0, 0, b"", {}, []
        _notice(run, f"{RECORD_FILE} shrank; reading it again from the start")
    before = len(run.records)
    started = time.monotonic()
    with gc_paused():
        _read_from(run, records_file, size, started, progress)
    if progress and time.monotonic() - started > 1.0:
        print(f"\rreading {records_file}: done, {len(run.records):,} records in "
              f"{time.monotonic() - started:.1f}s", file=sys.stderr)
    if final and run.pending.strip():
        line_no = run.lines + 1
        obj, err = _parse_line(run.pending)
        if obj is not None:
            _add_record(run, obj, line_no)
        elif run.pending.lstrip().startswith(b"{"):
            _notice(run, f"line {line_no}: torn last line (unterminated, {err}); skipped, "
                         f"{len(run.records)} earlier records kept")
        else:
            _notice(run, f"line {line_no}: {len(run.pending):,} bytes of garbage after the last record "
                         f"({err}); skipped")
        run.lines += 1
        run.pending = b""
    if final:
        for schema, count in run.other_schemas.items():
            _notice(run, f"{count} record(s) have schema {schema}; this reader knows schema "
                         f"{SCHEMA_VERSION} and reads the keys it recognises")
        run.other_schemas = {}
    return len(run.records) - before


def _read_from(run: Run, records_file: Path, size: int, started: float, progress: bool) -> None:
    shown = 0.0
    tty = sys.stderr.isatty()
    with open(records_file, "rb") as f:
        f.seek(run.offset)
        while True:
            chunk = f.read(4 << 20)
            if not chunk:
                break
            run.offset += len(chunk)
            _consume(run, chunk)
            elapsed = time.monotonic() - started
            # Only talk when it is slow enough for someone to wonder whether it hangs; a log file
            # (not a terminal) gets a line every few seconds instead of carriage-return updates.
            if progress and elapsed > 1.0 and elapsed - shown > (0.25 if tty else 3.0):
                shown = elapsed
                pct = 100.0 * run.offset / max(size, 1)
                print(f"\rreading {records_file}: {pct:3.0f}% ({len(run.records):,} records)",
                      end="" if tty else "\n", file=sys.stderr, flush=True)


def _notice(run: Run, text: str) -> None:
    if text not in run.notices:
        run.notices.append(text)


def _consume(run: Run, chunk: bytes) -> None:
    lines = (run.pending + chunk).split(b"\n")
    run.pending = lines.pop()
    for raw in lines:
        run.lines += 1
        if not raw.strip():
            continue
        obj, err = _parse_line(raw)
        if obj is None:
            _notice(run, f"line {run.lines}: malformed record ({err}); skipped")
        else:
            _add_record(run, obj, run.lines)


_LOGITS_CHARS = b"0123456789.-+eE[], \tnul"   # numbers, brackets and null; NaN/Infinity fail this


def _cut_logits(raw: bytes):
    """Split the holdout logits matrix off a line: (rest of the line, logits bytes) or (raw, None).

    Decoding thousands of logit floats per record is most of the parse time on big runs, and only the
    per-example loss check needs them, so they stay bytes until asked for (see holdout_logits_of)."""
    h = raw.find(b'"holdout_logits"')
    k = raw.find(b'"logits"', h) if h >= 0 else -1
    if k < 0 or raw.find(b"}", h, k) >= 0:   # no logits, or they belong to another section
        return raw, None
    v = k + 8
    while raw[v:v + 1] in (b" ", b":"):
        v += 1
    if raw[v:v + 2] != b"[[":
        return raw, None
    end = raw.find(b"]]", v)
    if end < 0:
        return raw, None
    value = raw[v:end + 2]
    if value.translate(None, _LOGITS_CHARS):
        return raw, None   # something unexpected inside: let the strict parser judge the whole line
    after = end + 2
    while raw[after:after + 1] == b" ":
        after += 1
    if raw[after:after + 1] == b",":
        return raw[:k] + raw[after + 1:], value
    before = k
    while raw[before - 1:before] == b" ":
        before -= 1
    if raw[before - 1:before] == b",":
        return raw[:before - 1] + raw[after:], value
    return raw, None


def holdout_logits_of(h: dict):
    """The holdout logits matrix of one evaluation as a list of lists, or None."""
    lg = h.get("logits")
    if isinstance(lg, bytes):
        try:
            lg = _DECODER.decode(lg.decode("ascii"))
        except (ValueError, UnicodeDecodeError, RecursionError):
            lg = None
        h["logits"] = lg
    return lg if isinstance(lg, list) else None


def _parse_line(raw: bytes):
    """(record, None) or (None, why not) for one line."""
    rest, logits = _cut_logits(raw)
    obj, err = _parse_object(rest)
    if obj is not None and logits is not None:
        h = obj.get("holdout_logits")
        if not isinstance(h, dict) or "logits" in h:
            return _parse_object(raw)
        h["logits"] = logits
    return obj, err


def _parse_object(raw: bytes):
    try:
        obj = _DECODER.decode(raw.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        return None, _first_line(exc)
    except RecursionError:
        return None, "nested too deeply"
    return (obj, None) if isinstance(obj, dict) else (None, f"a JSON {type(obj).__name__}, not an object")


# Top-level record fields that checks read as a whole, and the type each must have. A field of another
# type is dropped from its record (with a notice), so no check meets it; values inside sections are
# read through _num and isinstance tests instead.
RECORD_FIELDS = {
    **dict.fromkeys(("gradient_norm", "weight_delta", "learning_rates", "update_ratio", "drift", "weight_norm",
                     "holdout_logits", "batch_stats", "layer_stats", "lora", "system", "param_change",
                     "sparse_quality", "errors"), dict),
    **dict.fromkeys(("alerts", "nonfinite", "nonfinite_params"), list),
    "timestamp": str,
}


def _add_record(run: Run, rec: dict, line_no: int) -> None:
    for key, kind in RECORD_FIELDS.items():
        value = rec.get(key)
        if value is not None and not isinstance(value, kind):
            _notice(run, f"line {line_no}: {key} is {_kind(value)}, not {_kind(kind())}; left out")
            del rec[key]
    schema = rec.get("schema")
    if schema != SCHEMA_VERSION:
        schema = _text(schema, 40)
        run.other_schemas[schema] = run.other_schemas.get(schema, 0) + 1
    step = rec.get("step")
    if not _has_type(step, int):
        if step is not None:
            _notice(run, f"line {line_no}: step is {_kind(step)}, not an integer; numbered after the "
                         "previous record")
        # Older writers had no global step; number the records so plots still have an x axis.
        step = (run.records[-1]["step"] + 1) if run.records else 1
        rec["step"] = step
    _note_restart(run, rec, line_no)
    run.records.append(rec)


def _note_restart(run: Run, rec: dict, line_no: int) -> None:
    """A record that opens a process start (`"start": k`, k >= 1 for a resume) or whose step goes back
    (another run appended without a marker) begins a new segment of the run."""
    start = rec.get("start")
    if start is not None and not (_has_type(start, int) and start >= 0):
        _notice(run, f"line {line_no}: start is {_kind(start)}, not an index into {RUN_FILE}'s starts; ignored")
        del rec["start"]
        start = None
    prev = run.records[-1]["step"] if run.records else None
    if start is not None and (start >= 1 or prev is not None):
        run.restarts.append({"step": rec["step"], "start": start, "index": len(run.records)})
    elif prev is not None and rec["step"] < prev:
        _notice(run, f"line {line_no}: step goes back from {prev} to {rec['step']} with no restart marker "
                     "(another run appended to this file?); read as a new segment")
        run.restarts.append({"step": rec["step"], "start": None, "index": len(run.records)})


def segment_ids(run: Run) -> np.ndarray:
    """Per record, the index of its segment: the stretch between restarts. Loss spikes, gradient
    growth, jumps and shrinking, and forgetting events are judged within each segment alone: a resume
    reloads state and may change the batch size or the learning rate, and an appended run is another
    training altogether. Verdicts on the training as a whole (not learning, overfitting, holdout at
    chance) span the segments, since a resume continues the same training."""
    firsts = [r["index"] for r in run.restarts if r["index"] > 0]
    return np.searchsorted(np.array(firsts, dtype=int), np.arange(len(run.records)), side="right")


def _pieces(seg: np.ndarray) -> list:
    """Index arrays of the stretches of equal segment id in `seg` (a series' segment ids)."""
    return np.split(np.arange(len(seg)), np.flatnonzero(np.diff(seg)) + 1) if len(seg) else []


def _get(rec, parts):
    for p in parts:
        if not isinstance(rec, dict):
            return None
        rec = rec.get(p)
    return rec


def _num(v) -> float:
    """A record value as a float; NaN when it is absent, not a number, or out of float range (the
    writer stores NaN/Inf as null, so a literal like 1e400 is damage, not a measurement)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return math.nan
    try:
        v = float(v)
    except OverflowError:
        return math.nan
    return v if math.isfinite(v) else math.nan


_PLAIN_NUMBER_TYPES = {float, int, type(None)}


def _grown(run: Run, key, extend):
    """run.cache[key], brought up to date with the records added since it was made.

    extend(previous value or None, start) returns the value over all records, given the one over
    run.records[:start]; --watch reads a run a few lines at a time, so each cached view grows instead
    of being rebuilt from the first record."""
    entry = run.cache.get(key)
    if entry is None or entry[0] != len(run.records):
        done, old = entry or (0, None)
        entry = (len(run.records), extend(old, done))
        run.cache[key] = entry
    return entry[1]


def _concat(old, new):
    return new if old is None else np.concatenate([old, new])


def column(run: Run, key) -> np.ndarray:
    """Values at a dotted path (or a tuple of keys, for keys that hold dots such as layer names), one
    per record, NaN where absent/null. Cached, and grown incrementally as --watch reads more."""
    return _grown(run, ("col", key), lambda old, start: _concat(old, _column_values(run.records[start:], key)))


def _values_at(recs: list, parts: list) -> list:
    """The value at the key path `parts` of each record (None where absent)."""
    # The one- and two-level paths cover nearly every lookup; spelled out they are several times faster.
    if len(parts) == 1:
        a, = parts
        return [r.get(a) for r in recs]
    if len(parts) == 2:
        a, b = parts
        return [d.get(b) if isinstance(d := r.get(a), dict) else None for r in recs]
    if len(parts) == 3:
        a, b, c = parts
        return [e.get(c) if isinstance(d := r.get(a), dict) and isinstance(e := d.get(b), dict) else None
                for r in recs]
    return [_get(r, parts) for r in recs]


def _column_values(recs: list, key) -> np.ndarray:
    vals = _values_at(recs, list(key) if isinstance(key, tuple) else key.split("."))
    try:
        if not set(map(type, vals)) <= _PLAIN_NUMBER_TYPES:
            raise TypeError
        arr = np.array(vals, dtype=float).reshape(len(vals))   # None -> nan
        if not np.isfinite(arr[~np.isnan(arr)]).all():   # 1e400 in the file: damage, as in _num
            raise ValueError
        return arr
    except (TypeError, ValueError, OverflowError):
        return np.fromiter((_num(v) for v in vals), dtype=float, count=len(vals))


def present(run: Run, section: str) -> np.ndarray:
    """Boolean mask of records that hold `section` as a dict."""
    return _grown(run, ("present", section), lambda old, start: _concat(
        old, np.array([isinstance(r.get(section), dict) for r in run.records[start:]], dtype=bool)))


def nonfinite_at(run: Run, path: str) -> np.ndarray:
    """Boolean mask of records whose `nonfinite` list names `path` (the value is NaN/Inf, not absent)."""
    def extend(index, start):
        index = {} if index is None else index
        for i, r in enumerate(run.records[start:], start):
            nf = r.get("nonfinite")
            if isinstance(nf, list):
                for p in nf:
                    index.setdefault(_text(p), []).append(i)
        return index
    mask = np.zeros(len(run.records), dtype=bool)
    mask[_grown(run, "nonfinite", extend).get(path, [])] = True
    return mask


def steps(run: Run) -> np.ndarray:
    return column(run, "step")


def section_keys(run: Run, section: str, skip_overall: bool = True) -> list:
    """Keys seen in a dict section across records, in first-seen order ('overall' left out)."""
    def extend(seen, start):
        seen = dict.fromkeys(seen or ())
        dicts = _values_at(run.records[start:], section.split("."))
        # Records mostly share one key layout: collect the distinct layouts (in first-seen order) and
        # merge those, instead of visiting every key of every record.
        for layout in dict.fromkeys(tuple(d) for d in dicts if type(d) is dict):
            seen.update(dict.fromkeys(layout))
        return list(seen)
    return [k for k in _grown(run, ("keys", section), extend) if not (skip_overall and k == "overall")]


def has_values(run: Run, key: str) -> bool:
    return bool(np.isfinite(column(run, key)).any())


@dataclass
class Holdout:
    """A run's holdout evaluations as arrays (those of its most common kind)."""
    kind: str                     # "classification", "lm" or "regression"
    steps: np.ndarray             # step of each evaluation
    accuracy: np.ndarray          # per evaluation, NaN where absent (always, for regression)
    loss: np.ndarray              # mean squared error, for regression
    mae: np.ndarray               # mean absolute error (regression only; NaN otherwise)
    n: int                        # examples per evaluation
    num_classes: int | None
    labels: np.ndarray | None     # labels of the last evaluation that has per-example data
    matrix_steps: np.ndarray      # the steps of the columns of `correct`
    matrix_segments: np.ndarray   # the segment (see segment_ids) of each column of `correct`
    # examples x evaluations: right/wrong, LM per-example token accuracy, or regression absolute error
    correct: np.ndarray | None
    predictions_last: list        # predictions of the last (up to) three evaluations with per-example data
    raw: list                     # each evaluation's holdout_logits dict


def holdout_data(run: Run) -> Holdout | None:
    """The run's holdout evaluations, or None when no record has one."""
    return _grown(run, "holdout", lambda old, start: _holdout(run))


def _holdout(run: Run) -> Holdout | None:
    picked = [i for i, r in enumerate(run.records) if isinstance(r.get("holdout_logits"), dict)]
    if not picked:
        return None
    rows = [(run.records[i]["step"], run.records[i]["holdout_logits"]) for i in picked]
    kinds = [k if isinstance(k := h.get("kind"), str) and k else ("lm" if "nll" in h else "classification")
             for _, h in rows]
    kind = max(set(kinds), key=kinds.count)
    rows = [row for row, k in zip(rows, kinds) if k == kind]
    segments = segment_ids(run)[[i for i, k in zip(picked, kinds) if k == kind]]
    if kind == "classification" and (read := _single_probabilities(rows)) is not None:
        rows = read
        _notice(run, "the holdout's single outputs lie in [0, 1] at every evaluation: read as probabilities "
                     "(class 1 above 0.5, the loss as binary cross-entropy on them), not as logits")
    elif kind == "classification":
        rows = _single_logits(rows)
    n, keep, correct = _holdout_matrix(rows, kind)
    num_classes, labels = _holdout_classes(rows, keep) if kind == "classification" else (None, None)
    return Holdout(
        kind=kind,
        steps=np.array([s for s, _ in rows], dtype=float),
        accuracy=np.array([_num(h.get("accuracy")) for _, h in rows]),
        loss=np.array([_num(h.get("loss")) for _, h in rows]),
        mae=np.array([_num(h.get("mae")) for _, h in rows]),
        n=n or _get(run.meta, ["holdout", "examples"]) or 0,
        num_classes=num_classes,
        labels=labels,
        matrix_steps=np.array([rows[i][0] for i in keep], dtype=float),
        matrix_segments=segments[keep],
        correct=correct,
        predictions_last=[rows[i][1].get("predictions") for i in keep[-3:]] if keep else [],
        raw=[h for _, h in rows])


def _single_probabilities(rows: list):
    """The rows with predictions, accuracy and loss recomputed from probabilities, when a binary classifier's
    one output per example lies in [0, 1] at every evaluation (3 or more, or as few as telemetry read as
    probabilities at every one): a model ending in a sigmoid, trained with BCELoss, whose outputs a telemetry
    that reads them as logits records as class 1 above 0, where every probability is. A model of logits
    leaves [0, 1] once it has learned anything (class 0 gets negative ones). None otherwise."""
    read = []
    for step, h in rows:
        p, y = _single_outputs(h)
        if p is None or not np.all((p >= 0) & (p <= 1)):
            return None
        pred = (p > 0.5).astype(int)
        eps = 1e-7
        loss = -np.mean(y * np.log(np.clip(p, eps, 1)) + (1 - y) * np.log(np.clip(1 - p, eps, 1)))
        read.append((step, {**h, "predictions": pred.tolist(), "accuracy": float(np.mean(pred == y)),
                            "loss": float(loss)}))
    return read if len(read) >= 3 or read and all(h.get("probabilities") is True for _, h in rows) else None


def _single_logits(rows: list) -> list:
    """The rows, with those telemetry read as probabilities (its outputs had not yet left [0, 1]) read as
    logits again, as the run's later outputs show them to be: class 1 above 0, the loss as binary
    cross-entropy on their sigmoid."""
    read = []
    for step, h in rows:
        x, y = _single_outputs(h) if h.get("probabilities") is True else (None, None)
        if x is not None:
            pred = (x > 0).astype(int)
            loss = np.mean(np.logaddexp(0, x) - y * x)  # -[y log s(x) + (1 - y) log(1 - s(x))]
            h = {**h, "predictions": pred.tolist(), "accuracy": float(np.mean(pred == y)), "loss": float(loss),
                 "probabilities": False}
        read.append((step, h))
    return read


def _single_outputs(h: dict) -> tuple:
    """(outputs, labels) as float arrays of a binary classifier with one output per example, or (None, None)."""
    p, y = h.get("logits"), h.get("labels")
    if not (h.get("num_classes") == 2 and isinstance(p, list) and isinstance(y, list) and len(p) == len(y)
            and p and all(_has_type(v, (int, float)) for v in p) and all(v in (0, 1) for v in y)):
        return None, None
    return np.array(p, dtype=float), np.array(y, dtype=float)


def _holdout_matrix(rows: list, kind: str):
    """(examples per evaluation, indices of the evaluations of that size, their examples x evaluations
    matrix): `correct` for classification, per-example token accuracy for language models, per-example
    absolute error for regression."""
    # One array conversion for all evaluations, not one per record: this is the slow part on big runs.
    if kind == "classification":
        pairs = [(h.get("labels"), h.get("predictions")) for _, h in rows]
        sizes = [len(a) if _is_class_list(a) and _is_class_list(b) and len(a) == len(b) else 0
                 for a, b in pairs]
    else:
        toks = [h.get("abs_error" if kind == "regression" else "token_accuracy") for _, h in rows]
        sizes = [len(t) if isinstance(t, list) else 0 for t in toks]
    nonzero = [k for k in sizes if k]
    n = max(set(nonzero), key=nonzero.count) if nonzero else 0
    keep = [i for i, k in enumerate(sizes) if n and k == n]
    if not keep:
        return n, keep, None
    try:
        if kind == "classification":
            return n, keep, (np.array([pairs[i][0] for i in keep]) == np.array([pairs[i][1] for i in keep])).T
        return n, keep, np.array([[_num(v) for v in toks[i]] for i in keep]).T
    except (ValueError, TypeError):
        return n, [], None


def _is_class_list(v) -> bool:
    """A list of class indices: integers (no booleans) that fit in 32 bits."""
    return isinstance(v, list) and set(map(type, v)) <= {int} and (not v or -2 ** 31 <= min(v) and max(v) < 2 ** 31)


def _holdout_classes(rows: list, keep: list):
    """(number of classes, labels of the last evaluation in `keep`) of a classification holdout."""
    num_classes = labels = None
    for _, h in reversed(rows):
        nc = h.get("num_classes")
        nc = nc if _has_type(nc, int) and nc < 2 ** 31 else None
        lg = holdout_logits_of(h) if nc is None else None
        if nc is not None and nc >= 2:
            num_classes = nc
        elif isinstance(lg, list) and lg and isinstance(lg[0], list) and len(lg[0]) >= 2:
            num_classes = len(lg[0])
        if num_classes:
            break
    if keep:
        lab = rows[keep[-1]][1].get("labels")
        labels = np.array(lab) if lab else None
        if num_classes is None and labels is not None:
            preds = rows[keep[-1]][1].get("predictions") or []
            num_classes = max(2, int(max(list(lab) + list(preds))) + 1)
    return num_classes, labels


def train_accuracy_key(run: Run):
    """The user scalar that holds train accuracy, if the training loop passed one."""
    for key in ("train_acc", "train_accuracy", "accuracy", "acc"):
        if any(isinstance(r.get(key), (int, float)) for r in run.records[:50] + run.records[-50:]):
            return key
    return None


def flat_record(rec: dict) -> dict:
    """Nested sections become dotted columns; lists (logits, labels, alerts...) are left out."""
    out = {}
    # Depth first in key order, on a stack of iterators rather than by recursion: a damaged record may
    # nest hundreds deep.
    stack = [("", iter(rec.items()))]
    while stack:
        prefix, items = stack[-1]
        for k, v in items:
            key = f"{prefix}{k}"
            if isinstance(v, dict):
                stack.append((key + ".", iter(v.items())))
                break
            if not isinstance(v, (list, bytes)):   # bytes: holdout logits not yet decoded (a list too)
                out[key] = v
        else:
            stack.pop()
    return out


def flat_rows(run: Run):
    """(columns, rows) for CSV/pandas: one dict per record, columns in first-seen order."""
    rows = [flat_record(r) for r in run.records]
    lead = ["schema", "step", "batch_idx", "epoch", "timestamp", "loss"]
    seen = dict.fromkeys(lead)
    for row in rows:
        seen.update(dict.fromkeys(row))
    return list(seen), rows


def merged_rows(runs):
    """(columns, [(run name, row)]) of several runs: the union of their columns in first-seen order."""
    all_cols, all_rows = {}, []
    for run in runs:
        cols, rows = flat_rows(run)
        all_cols.update(dict.fromkeys(cols))
        all_rows += [(run.name, r) for r in rows]
    return list(all_cols), all_rows


def to_dataframe(runs):
    """One run directory (str or Path) or a list of them as one pandas DataFrame: a row per record, a
    leading `run` column with the run's name, `timestamp` as datetimes (NaT where unreadable; in UTC when
    records disagree on the time zone), the other columns named as in --csv. pandas is only needed here."""
    import pandas as pd
    dirs = [runs] if isinstance(runs, (str, Path)) else list(runs)
    loaded = [load_run(d, progress=False) for d in dirs]
    _unique_names(loaded)
    columns, rows = merged_rows(loaded)
    columns = ["run"] + [c for c in columns if c != "run"]   # the run's name wins over a scalar called "run"
    df = pd.DataFrame([{**row, "run": name} for name, row in rows], columns=columns)
    text = df["timestamp"].map(lambda v: v if isinstance(v, str) else None)
    try:
        df["timestamp"] = pd.to_datetime(text, errors="coerce", format="ISO8601")
    except ValueError:   # time zones that differ between records: one common zone, UTC
        df["timestamp"] = pd.to_datetime(text, errors="coerce", format="ISO8601", utc=True)
    return df


# ---- Diagnosis --------------------------------------------------------------------------------------

@dataclass
class Finding:
    code: str
    severity: str          # info | warning | critical
    message: str           # plain words, with the numbers that triggered it
    steps: list            # where (record steps)
    hint: str              # what to try
    group: str = None
    source: str = "analyzer"   # or "telemetry" for alerts the writer raised itself
    # Findings that follow from this one (the loss and gradient echoes of one spike, the holdout of a run
    # that never learned): listed here, under their cause, rather than beside it (see rank_findings).
    consequences: list = field(default_factory=list)
    # The codes it may explain, where its own evidence narrows CONSEQUENCES (a class imbalance that the
    # holdout shares too explains nothing about the holdout); None: all that CONSEQUENCES lists. Internal:
    # not in --json.
    explains_only: tuple = field(default=None, repr=False)


def _finite(x: np.ndarray) -> np.ndarray:
    return x[np.isfinite(x)]


def _edge_median(x: np.ndarray, which: str, frac: float = 0.2, min_n: int = 3) -> float:
    x = _finite(x)
    if not len(x):
        return math.nan
    # At most half of them: with few values, the first and the last windows do not overlap (three records
    # would otherwise give one median for both ends)
    k = min(max(1, len(x) // 2), max(min_n, int(math.ceil(frac * len(x)))))
    return float(np.median(x[:k] if which == "first" else x[-k:]))


def _fmt(v, digits: int = 3) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "n/a"
    if isinstance(v, (int, np.integer)) and not isinstance(v, bool):
        return f"{int(v):,}"
    v = float(v)
    if v == 0:
        return "0"
    if abs(v) >= 1e4 or abs(v) < 1e-3:
        return f"{v:.{max(digits - 1, 1)}e}"
    return f"{v:.{digits}g}"


def _steps_list(s, limit: int = 10) -> list:
    out = []
    for v in s:
        v = int(v)
        if v not in out:
            out.append(v)
        if len(out) >= limit:
            break
    return out


def _prev_window_stats(x: np.ndarray, window: int, min_hist: int, with_mad: bool = True):
    """Median and MAD of the `window` values before each point (NaN until min_hist values exist)."""
    n = len(x)
    med = np.full(n, np.nan)
    mad = np.full(n, np.nan)
    for i in range(min_hist, min(window, n)):
        h = x[:i]
        med[i] = np.median(h)
        mad[i] = np.median(np.abs(h - med[i])) if with_mad else np.nan
    if n > window:
        win = np.lib.stride_tricks.sliding_window_view(x[:-1], window)   # win[j] = x[j:j+window]
        m = np.median(win, axis=1)
        med[window:] = m
        if with_mad:
            mad[window:] = np.median(np.abs(win - m[:, None]), axis=1)
    return med, mad


def _groups(run: Run, section: str) -> list:
    return section_keys(run, section)


def _meta_groups(run: Run) -> dict:
    """run.json's groups ({name: {tensors, elements, names, and frozen_tensors, frozen_elements, frozen_names
    where some of the group's parameters have requires_grad=False}}), well-formed entries only."""
    groups = run.meta.get("groups")
    return {g: v for g, v in groups.items() if isinstance(v, dict)} if isinstance(groups, dict) else {}


def _optimizer_settings(run: Run) -> dict:
    """run.json's optimizer_settings ({group: {betas, eps, momentum, weight_decay}} as the group has them),
    well-formed entries only."""
    settings = run.meta.get("optimizer_settings")
    return {g: v for g, v in settings.items() if isinstance(v, dict)} if isinstance(settings, dict) else {}


def _count(info: dict, key: str) -> int:
    value = info.get(key)
    return value if _has_type(value, int) and value > 0 else 0


def _outside_optimizer(run: Run, g: str) -> bool:
    """A group that holds no tensor the optimizer updates: telemetry's not_in_optimizer group, or a group
    whose tensors run.json lists among those in no optimizer group. Its learning rate means nothing."""
    if g == NOT_IN_OPTIMIZER:
        return True
    info = run.meta.get(NOT_IN_OPTIMIZER)
    outside = set(info.get("names") or []) if isinstance(info, dict) and isinstance(info.get("names"), list) else set()
    names = _meta_groups(run).get(g, {}).get("names")
    return bool(outside) and isinstance(names, list) and bool(names) and set(map(str, names)) <= outside


def _wholly_frozen(run: Run, g: str) -> bool:
    """run.json says every parameter of group g has requires_grad=False."""
    info = _meta_groups(run).get(g, {})
    return _count(info, "frozen_tensors") > 0 and not _count(info, "tensors")


def _median_lr(run: Run, g: str) -> float:
    lr = _finite(column(run, ("learning_rates", g)))
    return float(np.median(lr)) if len(lr) else math.nan


def _lr_zero_groups(run: Run) -> dict:
    """{group: (zero_count, considered, first_step)} for groups at LR 0 while another group trains."""
    # A group outside the optimizer has no learning rate of its own (not_in_optimizer reports it), and a
    # group whose parameters are all frozen does not need one.
    groups = [g for g in _groups(run, "learning_rates") if not _outside_optimizer(run, g)]
    if len(groups) < 2:
        return {}
    lrs = np.vstack([column(run, ("learning_rates", g)) for g in groups])
    st = steps(run)
    out = {}
    for i, g in enumerate(groups):
        if _wholly_frozen(run, g):
            continue
        others = np.delete(lrs, i, axis=0)
        others_train = np.nanmax(np.where(np.isfinite(others), others, -1), axis=0) > 0
        mask = others_train & np.isfinite(lrs[i])
        zero = mask & (lrs[i] == 0)
        # Most of the run, or the latest 3 collections: --watch should see it while it is happening.
        ongoing = mask.sum() >= 3 and zero[mask][-3:].all()
        if zero.sum() >= 1 and (zero.sum() >= 0.5 * mask.sum() or ongoing):
            out[g] = (int(zero.sum()), int(mask.sum()), int(st[zero][0]))
    return out


def check_frozen_parameters(run: Run) -> list:
    """Parameters frozen (requires_grad=False) inside an optimizer group whose learning rate is > 0: the
    optimizer was told to train them, so they were most likely frozen by mistake (or after it was built)."""
    # peft freezes the base model's weights inside the adapter's own group by design.
    lora = any(isinstance(r.get("lora"), dict) for r in run.records[:5])
    findings = []
    for g, info in _meta_groups(run).items():
        frozen, trainable, lr = _count(info, "frozen_tensors"), _count(info, "tensors"), _median_lr(run, g)
        if not (frozen and lr > 0) or (lora and trainable):
            continue
        still, moving = _count(info, "frozen_elements"), _count(info, "elements")
        share = still / (still + moving) if still + moving else 1.0
        names = [_text(n) for n in info.get("frozen_names") or [] if isinstance(n, str)]
        what = "all of its" if not trainable else f"{frozen} of its {frozen + trainable}"
        # A whole group frozen while its lr says train is the mistake of freezing after the optimizer was
        # built with that group's lr. Frozen tensors among trainable ones in one group may well be meant: a
        # pretrained backbone frozen before Adam(model.parameters()), which skips tensors without a .grad, a
        # common fine-tuning idiom; a warning says which, and the hint how to tell.
        findings.append(Finding(
            "frozen_parameters", "critical" if not trainable else "warning",
            f"group '{g}' has learning rate {_fmt(lr)} but {what} tensors ({_fmt(still)} weights, {share:.0%} of the "
            "group) have requires_grad=False, so the optimizer never changes them"
            + (f": {', '.join(names[:4])}{', ...' if len(names) > 4 else ''}" if names else "") + ".",
            _steps_list(steps(run)[:1]), group=g,
            hint="If they should train, call requires_grad_(True) on them (freezing after the optimizer was built "
                 "leaves their group's lr in place); if the freeze is meant, leave them out of the optimizer or "
                 "set that group's lr to 0."))
    return findings


RESTART_JUMP = 10.0   # a restart's weight change this many times a collection's usual one: other weights


def check_restart_from_scratch(run: Run) -> list:
    """A restart whose weights are not the ones the run left: their change from the reference (the weights the
    run held at its last collection) is RESTART_JUMP times the previous stretch's usual change, and the
    holdout loss is back at once where that stretch began, after it had come down. A new training written into
    the same run directory (the script run again), or a resume that loaded no checkpoint: what follows is
    another run's, measured as if one. A resume from an older checkpoint moves the weights as far, but
    comes back to a loss the run had on its way down, not to its start."""
    wd, loss, seg, st = column(run, "weight_delta.overall"), column(run, "holdout_logits.loss"), segment_ids(run), \
        steps(run)
    findings = []
    for restart in run.restarts:
        i = restart["index"]
        if i <= 0 or i >= len(run.records):
            continue
        before = seg == seg[i] - 1
        usual, held = _finite(wd[before][1:]), _finite(loss[before])
        if len(usual) < 3 or not len(held) or not (math.isfinite(wd[i]) and math.isfinite(loss[i])):
            continue
        usual, start, last = float(np.median(usual)), float(np.median(held[:3])), float(np.median(held[-3:]))
        if not (usual > 0 and wd[i] >= RESTART_JUMP * usual and last < 0.9 * start <= loss[i]):
            continue
        findings.append(Finding(
            "restart_from_scratch", "warning",
            f"at the restart at step {int(st[i])} the weights are not the ones the run left: they moved "
            f"{_fmt(float(wd[i]))} from the reference, {wd[i] / usual:.0f}x a collection's usual {_fmt(usual)}, "
            f"and the holdout loss went from {_fmt(last)} to {_fmt(float(loss[i]))} at once, back to where that run "
            f"began ({_fmt(start)}). The records after it are another training's.", [int(st[i])],
            hint="Give each run its own output_dir (output_dir=\"runs/{date}_{host}\" does); to resume a run, load "
                 "the model's and the optimizer's state from a checkpoint before training on."))
    return findings


# Weights moved back toward their start: the drift from W_0 fell by this share of itself in one collection,
# by a move that went mostly that way (its fall at least half the weight delta); and over all such
# collections the train loss jumped up from the collection before, by 3 standard errors of that jump (the
# noise of successive collections, the run's trend taken out) and by a tenth.
ROLLBACK_SHARE = 0.3
ROLLBACK_LOSS_RISE = 1.1


def _rollbacks(run: Run) -> tuple:
    """([(index, drift before, drift after)] of the collections at which the weights went back toward their
    start, within a segment (a resume may load older weights on purpose); the train loss's jumps there, each
    over its successive changes' median, in units of their noise; the mean ratio of the loss there to the
    loss at the collection before)."""
    drift, wd, loss = column(run, "drift.overall"), column(run, "weight_delta.overall"), column(run, "loss")
    events, z, ratios = [], [], []
    for part in _pieces(segment_ids(run)):
        x = loss[part]
        d = _finite(np.diff(x))
        noise = _noise_sd(_finite(x)) * math.sqrt(2)  # of one successive change
        for k in range(1, len(part)):
            i, a, b = part[k], drift[part[k - 1]], drift[part[k]]
            if not (math.isfinite(a) and math.isfinite(b) and math.isfinite(wd[i]) and a > 0):
                continue
            if a - b < ROLLBACK_SHARE * a or a - b < 0.5 * wd[i]:
                continue
            events.append((int(i), float(a), float(b)))
            if math.isfinite(x[k]) and math.isfinite(x[k - 1]) and x[k - 1] > 0 and noise > 0 and len(d):
                z.append((x[k] - x[k - 1] - float(np.median(d))) / noise)
                ratios.append(x[k] / x[k - 1])
    return events, (float(np.mean(z)) * math.sqrt(len(z)) if z else math.nan), \
        (float(np.mean(ratios)) if ratios else math.nan)


def check_weights_rolled_back(run: Run) -> list:
    """Weights put back toward where they started between two collections, outside the optimizer, with the
    train loss back up: an EMA or averaged copy loaded for evaluation and never swapped out (a backup taken as
    model.state_dict() holds the tensors themselves, which load_state_dict overwrites), a checkpoint loaded
    again, layers re-initialised. Training then goes over the same ground again. A resume is a new segment and
    not compared across."""
    events, z, rise = _rollbacks(run)
    if not (z >= 3 and rise >= ROLLBACK_LOSS_RISE):
        return []
    st, loss = steps(run), column(run, "loss")
    i, a, b = max(events, key=lambda e: (e[1] - e[2]) / e[1])
    lo, hi = loss[i - 1], loss[i]
    epochs = column(run, "epoch")
    at_epochs = all(math.isfinite(epochs[e[0]]) and epochs[e[0]] != epochs[e[0] - 1] for e in events)
    return [Finding(
        "weights_rolled_back", "warning",
        f"at {len(events)} collection(s) the weights went back toward their initial values between two "
        f"collections{', each at the start of an epoch' if at_epochs and len(events) > 1 else ''}: at step "
        f"{int(st[i])} their distance from the start fell from {_fmt(a)} to {_fmt(b)} while the train loss went "
        f"from {_fmt(lo)} to {_fmt(hi)} (at those collections it rose {rise:.2f}x from the one before, on "
        "average). Something outside the optimizer overwrote them, and training covers the same ground again.",
        _steps_list(st[[e[0] for e in events]]),
        hint="Look at what runs there (an evaluation, a checkpoint). Weights swapped for evaluation (EMA, SWA) must "
             "be swapped back from a copy: backup = copy.deepcopy(model.state_dict()), since model.state_dict() "
             "holds the very tensors load_state_dict then overwrites. A checkpoint loaded on purpose (the best "
             "one, at an lr drop) does this too.")]


def _optimizer_holds_none(run: Run) -> bool:
    """Whether run.json's groups say the optimizer holds no trainable tensor of the model: every group's
    count 0 (frozen ones), or no group at all (an optimizer built for another instance of the model)."""
    groups = {g: info for g, info in _meta_groups(run).items() if g != NOT_IN_OPTIMIZER}
    return isinstance(run.meta.get("groups"), dict) and not any(_count(info, "tensors") for info in groups.values())


# Adam's step per element is about lr * m / (sqrt(v) + eps): with eps this many times the gradients' typical
# size (their rms per element) or more, eps is the denominator and the steps shrink by that much.
EPS_DOMINATES = 10.0
EPS_LARGE = 1e-3   # ... and is this large: a small eps over tiny gradients (a large model's adapters) is a choice


def check_adam_eps_dominates(run: Run) -> list:
    """An Adam-like optimizer (a group with betas and eps in run.json's optimizer_settings) whose eps is
    EPS_DOMINATES times the group's gradients or more, per element (the median over the run of the recorded
    norm over the square root of its elements): its steps are lr * gradient / eps, those of SGD at a rate
    eps times smaller, not the lr-sized steps Adam is chosen for. An eps of 1 (TensorFlow's recipe for one
    model, or 1e-0 for 1e-8) on ordinary gradients."""
    groups, found = _meta_groups(run), []
    for g, values in _optimizer_settings(run).items():
        eps = values.get("eps") if "betas" in values else None
        elements = _get(groups, [g, "elements"])
        norms = _finite(column(run, ("gradient_norm", g))[1:])
        if not (_has_type(eps, (int, float)) and eps > 0 and _has_type(elements, int) and elements > 0
                and len(norms) >= 5):
            continue
        rms = float(np.median(norms)) / math.sqrt(elements)
        if 0 < rms and eps >= max(EPS_DOMINATES * rms, EPS_LARGE):
            found.append((_text(g), float(eps), rms))
    if not found:
        return []
    g, eps, rms = max(found, key=lambda f: f[1] / f[2])
    return [Finding(
        "adam_eps_dominates", "warning",
        f"group '{g}''s eps is {_fmt(eps)}, {eps / rms:,.0f}x its gradients' typical size per element "
        f"({_fmt(rms)}, the median norm over the run over the square root of its weights): eps is the "
        f"denominator of each step, which shrinks by that much, from lr-sized steps to lr x gradient / eps"
        + (f" (and {len(found) - 1} more group(s) so)" if len(found) > 1 else "") + ".",
        _steps_list(steps(run)[:1]), group=g,
        hint="Use Adam's eps as it comes (1e-8; 1e-6 under fp16): it only keeps the division safe. An eps of 1 or "
             "0.1 turns Adam into SGD at a rate eps times smaller.")]


BETAS_GROWTH = 5.0   # the weights' norm grew this many times over the run under unstable betas


def check_adam_betas_unstable(run: Run) -> list:
    """An Adam-like group whose betas break Adam's bound beta1 < sqrt(beta2) (betas swapped: (0.999, 0.9)),
    and whose weights' norm grew BETAS_GROWTH times from the first collection to the run's last fifth: with
    the second moment averaged over fewer steps than the first, |m| / sqrt(v) is unbounded, and the steps
    outgrow the learning rate while the gradients stay ordinary."""
    for g, values in _optimizer_settings(run).items():
        betas = values.get("betas")
        if not (isinstance(betas, list) and len(betas) == 2 and all(_has_type(b, (int, float)) for b in betas)
                and 0 <= betas[1] < 1 and betas[0] >= math.sqrt(betas[1])):
            continue
        norm = _finite(column(run, ("weight_norm", g)))
        if len(norm) < 5 or not norm[0] > 0:
            continue
        grown = _edge_median(norm, "last") / norm[0]
        if grown < BETAS_GROWTH:
            continue
        return [Finding(
            "adam_betas_unstable", "warning",
            f"group '{_text(g)}''s betas are ({_fmt(betas[0])}, {_fmt(betas[1])}): beta1 is not below sqrt(beta2) "
            f"({_fmt(math.sqrt(betas[1]))}), Adam's bound for steps no larger than the learning rate, and the "
            f"group's weights grew {grown:,.0f}x in norm over the run, from {_fmt(float(norm[0]))} to "
            f"{_fmt(_edge_median(norm, 'last'))}.", _steps_list(steps(run)[:1]), group=_text(g),
            hint="betas=(0.9, 0.999) as Adam has them: beta1 averages the gradients, beta2 their squares over more "
                 "steps. Swapped, the steps outgrow the learning rate.")]
    return []


def check_unregistered_parameters(run: Run) -> list:
    """Trainable tensors a module holds in a plain Python list, tuple or dict (run.json's unregistered, as
    telemetry.py finds them: they got gradients and are no parameters of the model): an optimizer built from
    model.parameters() never steps them, so those layers keep their initial weights while the rest trains
    around them."""
    info = run.meta.get("unregistered")
    held = {_text(k): v for k, v in info.items() if isinstance(v, list) and len(v) == 2
            and all(_has_type(x, int) for x in v)} if isinstance(info, dict) else {}
    if not held:
        return []
    said = "; ".join(f"{path} ({n} tensor(s), {_fmt(elements)} weights)" for path, (n, elements) in
                     list(held.items())[:4])
    return [Finding(
        "unregistered_parameters", "warning",
        f"the model holds trainable tensors in a plain Python list, tuple or dict: {said}. They got gradients, "
        "but they are no parameters of the model, so an optimizer built from model.parameters() never steps "
        "them: those layers keep their random initial weights while the rest trains around them.",
        _steps_list(steps(run)[:1]),
        hint="Hold them in nn.ModuleList (or nn.ModuleDict, nn.ParameterList): self.hidden = "
             "nn.ModuleList([nn.Linear(64, 64) for _ in range(3)]). Then build the optimizer again.")]


def check_not_in_optimizer(run: Run) -> list:
    """Trainable tensors that no optimizer param group holds: nothing updates them, and zero_grad() skips
    them, so their .grad keeps growing with every backward()."""
    info = run.meta.get(NOT_IN_OPTIMIZER)
    info = info if isinstance(info, dict) else {}
    tensors = _count(info, "tensors")
    seen = [s for s in ("gradient_norm", "weight_delta", "learning_rates") if NOT_IN_OPTIMIZER in _groups(run, s)]
    if not tensors and not seen:
        return []
    names = [_text(n) for n in info.get("names") or [] if isinstance(n, str)]
    what = (f"{tensors} trainable tensor(s) ({_fmt(_count(info, 'elements'))} weights"
            + (f": {', '.join(names[:4])}{', ...' if len(names) > 4 else ''}" if names else "") + ")"
            if tensors else "some parameters (the records' not_in_optimizer group)")
    none = tensors and _optimizer_holds_none(run)
    if none and info.get("gradients") == 0:   # no backward reached them either: not the model that trains
        return [Finding(
            NOT_IN_OPTIMIZER, "warning",
            f"{what} have requires_grad=True but are in no optimizer param group, and had no gradient: the "
            "optimizer holds none of the tensors of the model passed to on_batch_end, and no backward reaches "
            "them. It is a copy of the model that trains (an EMA or AveragedModel, one loaded again), and the "
            "records measure none of its weights.", _steps_list(steps(run)[:1]), group=NOT_IN_OPTIMIZER,
            hint="Pass on_batch_end the model the optimizer steps (the one the loss is computed with); an EMA is "
                 "evaluated through set_holdout_data's forward=, not in its place.")]
    return [Finding(
        NOT_IN_OPTIMIZER, "warning",
        f"{what} have requires_grad=True but are in no optimizer param group: the optimizer never updates them, "
        "and since optimizer.zero_grad() does not clear them either, their .grad only grows."
        + (" The optimizer holds none of the model's trainable tensors: it was built for another instance of "
           "the model (one created or loaded again after the optimizer), or it steps copies of the weights."
           if none else ""),
        _steps_list(steps(run)[:1]), group=NOT_IN_OPTIMIZER,
        hint="If they should train, add them to the optimizer (build it after the model is complete, or "
             "add_param_group); if another optimizer trains them, pass every optimizer to on_batch_end, as a "
             "list; if not, freeze them with requires_grad_(False), which also saves their gradient memory.")]


# Where a NaN shows first, in the order it spreads: the loss, then the gradients computed from it, then the
# weights and what is measured on them; a user's own metric last (it may be NaN for reasons of its own).
NONFINITE_ORDER = ("loss", "gradient_norm", "grad_profile", "parameter", "weight_delta", "update_ratio", "drift",
                   "weight_norm", "holdout_logits", "learning_rates")


GROUP_SECTIONS = ("gradient_norm", "weight_delta", "update_ratio", "drift", "weight_norm", "learning_rates")


def _spread_rank(path: str) -> int:
    head = path.replace("[", ".").replace(" ", ".").split(".")[0]
    if head in NONFINITE_ORDER:
        return NONFINITE_ORDER.index(head)
    return len(NONFINITE_ORDER) + (head == "custom")


def _scaler_skipped(r: dict) -> bool:
    return isinstance(r.get("grad_scaler"), dict) and r["grad_scaler"].get("skipped") is True


def _skipping_persists(run: Run) -> bool:
    """Whether the GradScaler skipped most steps from its first skip on, or the last three collected: then no
    scale it backs off to gets finite gradients, and the run is not training. A skip now and then is the
    scaler finding its scale, and nothing to report."""
    skipped = [_scaler_skipped(r) for r in run.records]
    if not any(skipped):
        return False
    after = skipped[skipped.index(True):]
    return 2 * sum(after) > len(after) >= 4 or (len(skipped) >= 3 and all(skipped[-3:]))


def check_nonfinite(run: Run) -> list:
    first, counts, affected = {}, {}, 0
    routine = not _skipping_persists(run)
    for r in run.records:
        paths = r.get("nonfinite") if isinstance(r.get("nonfinite"), list) else []
        params = r.get("nonfinite_params") if isinstance(r.get("nonfinite_params"), list) else []
        paths = [_text(p) for p in paths] + [f"parameter {_text(p)}" for p in params]
        if routine and _scaler_skipped(r):  # the scaler saw these gradients and skipped the step
            paths = [p for p in paths if "grad" not in p and not p.startswith("parameter ")]
        if paths:
            affected += 1
        for p in paths:
            first.setdefault(p, r["step"])
            counts[p] = counts.get(p, 0) + 1
    if not first:
        return []
    order = sorted(first, key=lambda p: (first[p], _spread_rank(p), p))
    head = order[0]
    # the group: that of the first per-group value to go (gradient_norm.head), the loss having none
    grouped = [p.replace("[", ".").split(".") for p in order if p.split(".")[0] in GROUP_SECTIONS]
    group = grouped[0][1] if grouped and len(grouped[0]) > 1 else None
    others = ", ".join(f"{p} (step {first[p]})" for p in order[1:6])
    more = f" and {len(order) - 6} more" if len(order) > 6 else ""
    msg = (f"NaN/Inf first at step {first[head]} in {head}"
           + (f"; also {others}{more}" if others else "")
           + f". {affected} of {len(run.records)} records hold non-finite values.")
    hint = ("Lower the learning rate or warm it up, clip gradients (clip_grad_norm_), check the inputs/labels of "
            "the first bad batch, and with fp16 use a GradScaler (or bf16).")
    if not routine:
        skipped = sum(_scaler_skipped(r) for r in run.records)
        msg += (f" The GradScaler skipped the step at {skipped} of them: its scale backs off and the gradients "
                "stay non-finite, so the weights do not train.")
        hint = ("Something overflows whatever the scale: check the inputs and labels of the first bad batch and "
                "the loss in fp16 (compute it in float32), lower the learning rate, or train in bf16.")
    return [Finding("nonfinite", "critical", msg, _steps_list(first[p] for p in order), group=group, hint=hint)]


def check_optimizers_in_turn(run: Run) -> list:
    """on_batch_end called after each of several optimizers in turn (a GAN's two steps), which telemetry warned
    of and noted in run.json: each record holds the groups of the optimizer of its call alone, so the others'
    tensors read as held by no optimizer, a batch handed to both calls as a repeated batch, and the weight
    deltas restart at every collection. What the records say of optimizers and batches follows from that."""
    if run.meta.get("optimizers_in_turn") is not True:
        return []
    return [Finding(
        "optimizers_in_turn", "warning",
        "on_batch_end was called after each of several optimizers in turn: each record holds one optimizer's "
        "groups, steps count once per call, and a batch passed to both calls counts twice. What the records say "
        "of tensors outside the optimizer, repeated batches and weight deltas comes from that, not from the "
        "training.", _steps_list(steps(run)[:1]),
        hint="Call it once per training step, after every optimizer stepped, with them as a list: "
             "on_batch_end(model, [opt_d, opt_g], ...).")]


# zero_grad() every few steps: the gradients' norm where they hold the most backward() passes, against where
# they hold the fewest, at least this ratio (passes of one loss's gradients add up, they do not cancel)
FEW_STEPS_NORM_RISE = 1.25


def check_gradients_never_zeroed(run: Run) -> list:
    """The loop never zeroes the gradients: at two or more collections telemetry saw the same gradient tensor
    changed in place exactly once per optimizer step since the previous one (backward() adding into it),
    so every step applies the sum of all the gradients so far. Or it zeroes them only every few steps (see
    _zeroed_every_few_steps)."""
    kept = [r["step"] for r in run.records if _has_type(r.get("step"), int)
            and _has_type(r.get("grads_never_zeroed"), int) and r["grads_never_zeroed"] > 0]
    if len(kept) < 2:
        return _zeroed_every_few_steps(run)
    return [Finding(
        "gradients_never_zeroed", "warning",
        f"the gradients are never zeroed: at {len(kept)} of {len(run.records)} collections the same gradient "
        f"tensors had changed in place exactly once per optimizer step since the previous one (backward() adds "
        f"into .grad), first at step {kept[0]}; every step applies the sum of all gradients so far, which "
        "grows with the run.", _steps_list(kept),
        hint="Call optimizer.zero_grad() once per optimizer step (before backward(), or after step() when "
             "accumulating gradients over several micro-batches).")]


def _zeroed_every_few_steps(run: Run) -> list:
    """The optimizer steps at every batch, but zero_grad() runs only every few steps: the passes of backward()
    the gradients hold when read (telemetry's accumulation section, which a step of one batch has only where
    its gradients were changed in place) climb from step to step and fall back, again and again, and the
    gradients' norm climbs with them. Each step re-applies the gradients of the steps since the last
    zero_grad(): gradient accumulation with step() inside the loop over micro-batches. A constant count
    (clipping, a loss of two backward() passes) is the loop's own, and says nothing."""
    if not any(isinstance(r.get("accumulation"), dict) and r["accumulation"].get("micro_batches") == 1
               for r in run.records):
        return []   # without a record that has one, a step's absent count is not known to be 1
    rows = []
    for r in run.records:
        a, norm = r.get("accumulation"), _get(r, ("gradient_norm", "overall"))
        if not (_has_type(r.get("step"), int) and _has_type(norm, (int, float)) and math.isfinite(norm)):
            continue
        if a is None:
            rows.append((r["step"], 1, norm))
        elif isinstance(a, dict) and a.get("micro_batches") == 1 and _has_type(a.get("backward_bound"), int):
            rows.append((r["step"], a["backward_bound"], norm))
    bounds = np.array([b for _, b, _ in rows])
    if len(rows) < 8 or len(set(bounds.tolist())) < 2:
        return []
    low, high = bounds.min(), bounds.max()
    at_low, at_high = (np.median([n for _, b, n in rows if b == v]) for v in (low, high))
    more = [st for st, b, _ in rows if b > low]
    falls = int((np.diff(bounds) < 0).sum())  # a count that only ever grew is a change of the loop (clipping begun)
    if len(more) < 3 or not 0.25 <= len(more) / len(rows) <= 0.9 or falls < 3 \
            or not at_high >= FEW_STEPS_NORM_RISE * at_low:
        return []
    return [Finding(
        "gradients_never_zeroed", "warning",
        f"the gradients are zeroed only every {high - low + 1} or so optimizer steps: at {len(more)} of {len(rows)} "
        f"collections they held more backward() passes than at the others (up to {high - low} more, counted by "
        f"their in-place changes), and their norm grew with them ({_fmt(at_low)} at the fewest, {_fmt(at_high)} at "
        "the most). Each step applies again the gradients of the steps since the last zero_grad().",
        _steps_list(more),
        hint="Call optimizer.zero_grad() after every optimizer.step(). To accumulate gradients over k "
             "micro-batches, call step() and zero_grad() together, once every k of them.")]


# The share of a run's batches that reached no optimizer step, beyond which a loop that skips them is named.
BATCHES_SKIPPED = 0.2


def check_batches_skipped(run: Run) -> list:
    """Batches that never reach an optimizer step, at a rate that varies: between collections in the same epoch
    the batch index advanced by more than the optimizer's steps, by different ratios (gradient accumulation
    gives one ratio, k batches a step). A loop that `continue`s past some batches, a guard on a NaN loss
    above all, trains on the others alone, and says nothing."""
    st, index, epoch, seg = steps(run), column(run, "batch_idx"), column(run, "epoch"), segment_ids(run)
    both = np.isfinite(index) & np.isfinite(epoch)
    pairs = np.array([(st[i + 1] - st[i], index[i + 1] - index[i]) for i in range(len(st) - 1)
                      if both[i] and both[i + 1] and epoch[i] == epoch[i + 1] and seg[i] == seg[i + 1]
                      and st[i + 1] > st[i] and index[i + 1] > index[i]])
    if len(pairs) < 8:
        return []
    taken, seen = pairs[:, 0], pairs[:, 1]
    ratios = seen / taken
    skipped = 1 - taken.sum() / seen.sum()
    if skipped < BATCHES_SKIPPED or (ratios != np.median(ratios)).mean() < 0.25:
        return []
    return [Finding(
        "batches_skipped", "warning",
        f"{skipped:.0%} of the batches never reached an optimizer step: between collections in the same epoch the "
        f"batch index advanced {int(seen.sum())} times and the optimizer stepped {int(taken.sum())} times, at a rate "
        f"that varies ({_fmt(ratios.min())} to {_fmt(ratios.max())} batches a step), which gradient accumulation "
        "does not. The loop skips some batches and trains on the others alone.", _steps_list(st[:1]),
        hint="Find why those batches are skipped and say so when they are: a guard such as `if not "
             "torch.isfinite(loss): continue` hides NaN or inf in the data (impute or drop those rows before "
             "training) or a model that blows up on them.")]


def check_accumulation_discarded(run: Run) -> list:
    """Gradient accumulation whose micro-batches are zeroed away: the optimizer steps once every k batches, yet
    at nearly every collection (9 in 10, 3 at least) the gradients had fewer in-place changes than k backward()
    passes would have left in them (see telemetry's accumulation section), so zero_grad() ran between the
    micro-batches and each step took the last ones alone: a batch k times smaller than meant."""
    rows = [(r["step"], a["micro_batches"], a["backward_bound"]) for r in run.records
            if isinstance(a := r.get("accumulation"), dict) and _has_type(r.get("step"), int)
            and _has_type(a.get("micro_batches"), int) and _has_type(a.get("backward_bound"), int)]
    short = [row for row in rows if row[2] < row[1]]
    if len(short) < 3 or len(short) < 0.9 * len(rows):
        return []
    micro, held = int(np.median([m for _, m, _ in short])), max(b for _, _, b in short)
    return [Finding(
        "accumulation_discarded", "warning",
        f"gradient accumulation is undone: the optimizer steps once every {micro} batches, but at {len(short)} of "
        f"{len(rows)} collections its gradients held at most {held} backward() pass(es). zero_grad() runs between "
        f"the micro-batches, so each step uses the last {held} of them alone: batches {micro // held}x smaller "
        "than meant, and the other micro-batches' gradients are computed for nothing.", _steps_list(
            [st for st, _, _ in short]),
        hint="Call optimizer.zero_grad() once per optimizer step, right after step(), and not between the "
             "micro-batches it accumulates.")]


def check_eval_mode(run: Run) -> list:
    """The model trains in eval mode: a validation pass's model.eval() without a model.train() after it.
    Telemetry records eval_mode (its dropout and BatchNorm layers) at the collections where the model was in
    eval mode at the hook; from the first such collection on, at 90% or more of them and at least 2."""
    st = [r.get("step") for r in run.records]
    marked = [i for i, r in enumerate(run.records) if isinstance(r.get("eval_mode"), dict)]
    if len(marked) < 2 or len(marked) < 0.9 * (len(run.records) - marked[0]):
        return []
    layers = run.records[marked[-1]]["eval_mode"]
    said = " and ".join(f"{n} {what}" for what, n in (("dropout layer(s) drop nothing", layers.get("dropout")),
                                                       ("BatchNorm layer(s) normalise with frozen running "
                                                        "statistics", layers.get("batchnorm")))
                        if _has_type(n, int) and n > 0) or "layers that depend on the mode act as in evaluation"
    return [Finding(
        "eval_mode", "warning",
        f"the model trains in eval mode: at {len(marked)} of the {len(run.records) - marked[0]} collections from "
        f"step {st[marked[0]]} on it was in eval mode at the hook, so its {said} while it trains.",
        _steps_list([st[i] for i in marked]),
        hint="Call model.train() after each evaluation pass (at the start of each epoch's training loop); "
             "model.eval() stays in force until then. To train without dropout, set its p to 0 instead: eval "
             "mode also freezes BatchNorm.")]


def check_missing_gradients(run: Run) -> list:
    has = present(run, "gradient_norm")
    considered = int(has.sum())
    if not considered:
        return []
    null = has & np.isnan(column(run, "gradient_norm.overall")) & ~nonfinite_at(run, "gradient_norm.overall")
    for g in _groups(run, "gradient_norm"):
        null &= np.isnan(column(run, ("gradient_norm", g)))
    missing = [int(v) for v in steps(run)[null]]
    if not missing or _optimizer_holds_none(run):
        return []   # no .grad to read, and nothing cleared it (frozen_parameters, not_in_optimizer)
    share = len(missing) / considered
    return [Finding(
        "missing_gradients", "critical" if share >= 0.5 else "warning",
        f"gradient_norm was null (no parameter had a .grad) in {len(missing)} of {considered} collections, "
        f"first at step {missing[0]}: the gradients were already cleared when telemetry looked.",
        _steps_list(missing),
        hint="Call on_batch_end before zero_grad: backward -> step -> on_batch_end -> zero_grad (or move "
             "optimizer.zero_grad() to the start of the loop); zero_grad(set_to_none=True) deletes .grad.")]


def check_lr_zero(run: Run) -> list:
    findings = []
    for g, (zero, considered, first) in _lr_zero_groups(run).items():
        wd = column(run, ("weight_delta", g))
        still = _finite(wd)
        moved = f" Its weight delta stayed {_fmt(float(np.max(still)))} at most." if len(still) else ""
        findings.append(Finding(
            "lr_zero", "critical",
            f"group '{g}' has learning rate 0 in {zero} of {considered} collections while other groups "
            f"train (first at step {first}).{moved}",
            [first], group=g,
            hint="Check that group's lr in the optimizer param groups and the scheduler (a LambdaLR factor of 0, "
                 "a warmup that never ends); if it is meant to be frozen, set requires_grad=False instead."))
    lr = column(run, "learning_rates.overall")
    if not has_values(run, "learning_rates.overall") and _groups(run, "learning_rates"):
        with warnings.catch_warnings():   # a collection where no group has a learning rate: NaN, said nowhere
            warnings.simplefilter("ignore", RuntimeWarning)
            lr = np.nanmax(np.vstack([column(run, ("learning_rates", g))
                                      for g in _groups(run, "learning_rates")]), axis=0)
    later = _finite(lr[1:])
    if len(later) >= 2 and np.all(later == 0):
        findings.append(Finding(
            "lr_zero", "critical",
            f"the learning rate is 0 for every group in all {len(later)} collections after the first.",
            _steps_list(steps(run)[1:2]),
            hint="Check the optimizer's lr and the scheduler (a warmup or LambdaLR that returns 0)."))
    return findings


# A schedule's learning rate this far below its peak moves the weights by a rounding error; a cosine or linear
# decay gets there only at its very end, so a fall this deep in the first half of a run is a schedule that
# counts something else than the loop's steps.
LR_COLLAPSE = 1e-3


def check_lr_collapsed(run: Run) -> list:
    """The learning rate (every group's: the largest) fell below LR_COLLAPSE of its peak in the first half of
    the run and stayed there: the rest of the run's steps move the weights by next to nothing, whatever the
    run had learned by then. A scheduler stepped per batch where it counts epochs, or a decay far too steep."""
    lr, st = column(run, "learning_rates.overall"), steps(run)
    ok = np.isfinite(lr) & (lr >= 0) if len(lr) else np.zeros(0, dtype=bool)
    if ok.sum() < 8:
        return []
    lr, st = lr[ok], st[ok]
    # An lr of 0 is collapsed too (a linear decay to 0 sized in epochs gets there in a few steps); one that is
    # 0 from the second collection on, lr_zero's, or at the first (a warmup from 0), is not a fall from a peak.
    if not lr[0] > 0 or not lr[1] > 0:
        return []
    peak = float(np.max(lr[: max(1, np.searchsorted(st, st[0] + 0.5 * (st[-1] - st[0]), "right"))]))
    floor = LR_COLLAPSE * peak * (1 + 1e-9)   # a schedule's products of 0.1 land a rounding above 1e-3
    low = np.flatnonzero(lr <= floor)
    if not len(low) or st[low[0]] - st[0] > 0.5 * (st[-1] - st[0]) or lr[low[0]:].max() > floor:
        return []
    i = int(low[0])
    share = (st[i] - st[0]) / max(st[-1] - st[0], 1)
    return [Finding(
        "lr_collapsed", "warning",
        f"the learning rate fell from its peak {_fmt(peak)} to {_fmt(float(lr[i]))} by step {int(st[i])}, {share:.0%} "
        f"into the run, and stayed below {LR_COLLAPSE:g} of the peak (it ends at {_fmt(float(lr[-1]))}): the "
        f"{1 - share:.0%} of the run after it moved the weights by next to nothing.",
        _steps_list([int(st[i]), int(st[-1])]),
        hint="A scheduler stepped once per batch where its step_size, T_max or milestones count epochs: step it once "
             "per epoch, or give it steps (StepLR(step_size=epochs * steps_per_epoch)); a linear or cosine decay's "
             "num_training_steps (total_steps) counts optimizer steps too, not epochs. Else check gamma and the "
             "schedule's length against the number of optimizer steps.")]


LR_BELOW_BASE = 0.05   # every group's learning rate under this share of the lr its scheduler started from
LR_UNFINISHED = 0.25   # ... or under this share and still climbing at the run's end: a warmup longer than the run
# OneCycleLR starts at max_lr / 25 and climbs to max_lr over the first 30% of its steps: a run that never gets
# past this share of it stepped the schedule once per epoch, or stopped long before the schedule's end.
LR_BELOW_MAX = 0.25


def check_lr_below_base(run: Run) -> list:
    """The learning rate never came near the one set on the optimizer: every group that a scheduler drives
    stayed, over the whole run, under LR_BELOW_BASE of the lr the scheduler started from (its initial_lr,
    which telemetry lists in run.json), or under LR_BELOW_MAX of the max_lr a OneCycleLR climbs to. A warmup
    that counts optimizer steps stepped once per epoch, or one longer than the run, or a schedule's factor off
    by orders of magnitude: the run trains at a rate its author never chose, and a stalled loss asks for a
    learning rate 3-10x higher when it is 100x."""
    bases, tops = (run.meta.get(key) if isinstance(run.meta.get(key), dict) else {}
                   for key in ("initial_lrs", "max_lrs"))
    peaks = {}
    for g in list(bases) + [g for g in tops if g not in bases]:
        # OneCycleLR's peak, where it set one: its initial_lr is only where it starts
        base, share = (tops[g], LR_BELOW_MAX) if g in tops else (bases[g], LR_BELOW_BASE)
        lr = _finite(column(run, ("learning_rates", g)))
        if not _has_type(base, (int, float)) or not base > 0 or len(lr) < 8:
            continue
        # a warmup longer than the run: still climbing over the run's last fifth when it ends
        rising = g not in tops and lr[-1] >= lr.max() and lr[-1] > 1.05 * lr[-max(2, len(lr) // 5)]
        peaks[g] = (float(lr.max()), float(base), LR_UNFINISHED if rising else share, g in tops, rising)
    if not peaks or any(peak >= share * base for peak, base, share, *_ in peaks.values()):
        return []
    said = "; ".join(f"group '{g}' peaked at {_fmt(peak)} against {_fmt(base)} ({peak / base:.2%}"
                     + (", its OneCycleLR's max_lr)" if cycle else ", still rising at the end)" if rising else ")")
                     for g, (peak, base, _, cycle, rising) in peaks.items())
    cycles, rises = (any(p[i] for p in peaks.values()) for i in (3, 4))
    return [Finding(
        "lr_below_base", "warning",
        "the learning rate never came near the one its scheduler was given, over the whole run ("
        + " or ".join(([f"under {LR_BELOW_MAX:.0%} of OneCycleLR's max_lr"] if cycles else [])
                      + ([f"under {LR_BELOW_BASE:.0%} of the lr it started from, the optimizer's lr"]
                         if not all(p[3] or p[4] for p in peaks.values()) else [])
                      + ([f"under {LR_UNFINISHED:.0%} of it and still warming up when the run ended"] if rises else []))
        + f"): {said}.", _steps_list(steps(run)[:1]),
        hint="A schedule that counts optimizer steps (a warmup: LambdaLR, LinearLR, "
             "get_linear_schedule_with_warmup; OneCycleLR's total_steps) but is stepped once per epoch, or that is "
             "longer than the run: call scheduler.step() after every optimizer.step(), or give it the run's "
             "length (OneCycleLR(..., epochs=E, steps_per_epoch=len(loader))); else check the schedule's factor.")]


# Significant bits of the low-precision formats weights are trained in: a value v in [2^e, 2^(e+1)) has a
# spacing of 2^(e + 1 - bits) to the next one, and round-to-nearest drops a step under half of it.
PRECISION_BITS = {"bfloat16": 8, "float16": 11}
# torch's optimizers whose step moves each element by about the learning rate or less, whatever the gradient's
# size (Adam's m/sqrt(v), Adagrad's and RMSprop's normalised steps), so the lr bounds the update.
BOUNDED_STEPS = ("Adam", "AdamW", "NAdam", "RAdam", "Adamax", "Adagrad", "RMSprop")


def check_low_precision_updates(run: Run) -> list:
    """Weights the optimizer steps in bfloat16 or float16 itself (run.json's low_precision: no float32 master
    copy), whose typical size is so large against the learning rate that a step of it is under half the
    format's spacing there and rounds away. With torch's Adam-like optimizers no element moves by much more
    than the lr, so a group's peak lr sets the weight size from which every update is lost, and the rms of its
    weights (weight_norm over the root of its elements) says that the typical weight is past it. The run then
    trains only its smallest weights: a model loaded in bf16 and fine-tuned at 1e-5 with AdamW."""
    low, groups = (run.meta.get(k) if isinstance(run.meta.get(k), dict) else {} for k in ("low_precision", "groups"))
    lost = {}
    for g, entry in low.items():
        optimizer = entry.get("optimizer") if isinstance(entry, dict) else None
        if not (isinstance(optimizer, str) and optimizer.startswith("torch.optim.")
                and optimizer.rsplit(".", 1)[-1] in BOUNDED_STEPS):
            continue
        held = [(k, v) for k, v in entry.items() if k in PRECISION_BITS and _has_type(v, int)]
        elements = groups.get(g, {}).get("elements") if isinstance(groups.get(g), dict) else None
        if not held or not _has_type(elements, int) or elements <= 0:
            continue
        dtype, count = max(held, key=lambda kv: kv[1])
        lr, norms = (_finite(column(run, (key, g))) for key in ("learning_rates", "weight_norm"))
        lr = lr[lr > 0]
        if count < elements / 2 or len(lr) < 3 or len(norms) < 3:
            continue
        peak, rms = float(lr.max()), float(np.median(norms)) / math.sqrt(elements)
        # the smallest power of two from which half the spacing exceeds a step of the peak lr
        cut = 2.0 ** (math.floor(math.log2(peak * 2 ** PRECISION_BITS[dtype])) + 1)
        if rms >= cut:
            lost[g] = (dtype, peak, cut, rms, optimizer.rsplit(".", 1)[-1])
    if not lost:
        return []
    said = "; ".join(f"group '{g}': {dtype} weights of rms {_fmt(rms)}, stepped by {opt} at a peak lr of {_fmt(peak)}, "
                     f"which rounds away at every weight of magnitude above {_fmt(cut)}"
                     for g, (dtype, peak, cut, rms, opt) in lost.items())
    return [Finding(
        "low_precision_updates", "warning",
        f"the optimizer steps low-precision weights itself, at a learning rate too small for their format: {said}. "
        "The typical weight never moves; only the smallest ones train.", _steps_list(steps(run)[:1]),
        hint="Keep the weights in float32 and compute in low precision under torch.autocast(dtype=torch.bfloat16) "
             "(with Hugging Face, load the model in float32 and set bf16=True), or use an optimizer that keeps "
             "float32 master weights or rounds stochastically. A larger learning rate only moves the cut.")]


# A OneCycleLR's lr climbs once and then falls for good: falling to under LR_RESTART_FALL of itself from one
# collection to the next and then climbing LR_RESTART_RISE-fold again is a schedule begun anew.
LR_RESTART_FALL = 0.5
LR_RESTART_RISE = 2.0


def check_lr_schedule_restarted(run: Run) -> list:
    """A OneCycleLR (its max_lr in run.json) whose lr fell back and climbed again, twice or more within one
    process: the scheduler was created again (each epoch, say), and each new one starts its warmup over. The
    lr saws up and down below max_lr, and the annealing the schedule ends with never comes."""
    tops = run.meta.get("max_lrs") if isinstance(run.meta.get("max_lrs"), dict) else {}
    st, seg = steps(run), segment_ids(run)
    found = {}
    for g, top in tops.items():
        lr = column(run, ("learning_rates", g))
        restarts = []
        for part in _pieces(seg):
            x = lr[part]
            for k in range(1, len(x)):
                if not (math.isfinite(x[k]) and math.isfinite(x[k - 1]) and 0 < x[k] < LR_RESTART_FALL * x[k - 1]):
                    continue
                if np.nanmax(x[k:]) >= LR_RESTART_RISE * x[k]:
                    restarts.append(int(part[k]))
        if len(restarts) >= 2 and _has_type(top, (int, float)):
            found[g] = (restarts, float(np.nanmax(lr)), float(top))
    if not found:
        return []
    g, (restarts, peak, top) = next(iter(found.items()))
    return [Finding(
        "lr_schedule_restarted", "warning",
        f"the OneCycleLR schedule started over {len(restarts)} times: group '{g}''s learning rate fell to under "
        f"half of itself from one collection to the next and then climbed again, at steps {', '.join(str(int(st[i])) for i in restarts[:6])}"
        f"{', ...' if len(restarts) > 6 else ''}; it peaked at {_fmt(peak)} ({peak / top:.0%} of max_lr "
        f"{_fmt(top)}), and the annealing the schedule ends with never came.", _steps_list(st[restarts]),
        group=g,
        hint="Create the scheduler once, before the epochs, for the whole run (OneCycleLR(..., epochs=E, "
             "steps_per_epoch=len(loader)) or total_steps), and step it after every optimizer.step(); when "
             "resuming, load its state_dict rather than making a new one.")]


# nn.Dropout's p is the share dropped: this much is TensorFlow's keep_prob written as p, or near it; and a
# train loss (with dropout) this many times the holdout's (without) over the run's end is held back by it.
DROPOUT_HIGH = 0.8
DROPOUT_HELD_BACK = 1.5
DROPOUT_UNTRAINED = 0.7  # ... or the train loss at this share of log K or more, while the holdout is mostly right


def check_dropout_too_high(run: Run) -> list:
    """Dropout layers that drop DROPOUT_HIGH or more of their inputs (run.json's dropout), while the train loss
    over the last fifth of the run is DROPOUT_HELD_BACK times the holdout's over its last quarter: the holdout
    is scored in eval mode, without the dropout, and the gap is what the dropout costs the training. Or, for a
    classifier, while that train loss is still DROPOUT_UNTRAINED of an untrained model's or more and the
    holdout is mostly right (half or more)."""
    heavy = {name: p for name, p in (run.meta.get("dropout") or {}).items()
             if _has_type(p, (int, float)) and p >= DROPOUT_HIGH} if isinstance(run.meta.get("dropout"), dict) else {}
    h, t = holdout_data(run), _loss_trend(run)
    late = _late(h, h.loss) if h and h.kind in ("classification", "regression") else None
    if not heavy or t is None or late is None or not late[0] > 0:
        return []
    untrained, _ = _chance_losses(run)
    if untrained is not None and _train_loss_on_another_scale(run, untrained):
        return []
    # a train loss still near an untrained model's while the holdout, scored without dropout, is mostly right:
    # the gap to the holdout's loss may be small where that loss is high too (a model unsure on whole inputs)
    acc = _late(h, h.accuracy) if h.kind == "classification" else None
    stalled = untrained is not None and acc is not None and t.last >= DROPOUT_UNTRAINED * untrained and acc[0] >= 0.5
    if t.last < DROPOUT_HELD_BACK * late[0] and not stalled:
        return []
    names = sorted(heavy, key=lambda n: -heavy[n])
    listed = ", ".join(f"{n} (p={heavy[n]:g})" for n in names[:4]) + (", ..." if len(names) > 4 else "")
    gap = (f"{_fmt(t.last)}, {t.last / untrained:.2g}x the {_fmt(untrained)} of a model that knows nothing, while "
           f"the holdout, scored without dropout, gets {acc[0]:.0%} right" if stalled else
           f"{_fmt(t.last)}, {t.last / late[0]:.2g}x the holdout's {_fmt(late[0])}, which is scored without dropout")
    return [Finding(
        "dropout_too_high", "warning",
        f"{len(heavy)} dropout layer(s) drop {min(heavy.values()):.0%} or more of their inputs while training: "
        f"{listed}. The train loss over the last fifth of the run is {gap}: the dropout holds the training back.",
        _steps_list(t.where),
        hint="nn.Dropout(p) takes the share to drop, not the share to keep (TensorFlow's keep_prob): p=0.1 keeps "
             "90%. Lower p; 0.1-0.5 is usual.")]


def check_ignored_group_key(run: Run) -> list:
    """Param-group keys the optimizer never reads that look like one it does ("learning_rate" for "lr"), with
    another value (telemetry.py lists them in run.json): that setting was never applied, and the learning
    rates the records show are what the group trained at. A head's 10x lr written so is otherwise invisible."""
    ignored = run.meta.get("ignored_group_keys")
    findings = []
    for g, keys in (ignored.items() if isinstance(ignored, dict) else []):
        for key, entry in (keys.items() if isinstance(keys, dict) else []):
            if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[1], str)
                    and all(math.isfinite(_num(v)) for v in (entry[0], entry[2]))):
                continue
            value, meant, used = _num(entry[0]), entry[1], _num(entry[2])
            optimizer = _text(run.meta.get("optimizer") or "the optimizer")
            findings.append(Finding(
                "ignored_group_key", "warning",
                f"group '{_text(g)}' sets {_text(key)}={_fmt(value)}, a key {optimizer} never reads: the group "
                f"trained with {_text(meant)}={_fmt(used)}" + (f" ({_fmt(value / used)}x less than meant)"
                                                               if meant == "lr" and used and value > used else "")
                + ".", _steps_list(steps(run)[:1]), group=_text(g),
                hint=f"Spell the key as the optimizer does ({_text(meant)}); the learning rates each group "
                     "trained at are in the records' learning_rates."))
    return findings


def _probability_outputs(h: Holdout):
    """The number of classes when the model's outputs are probabilities: every holdout row of the last three
    evaluations with outputs lies in [0, 1] and sums to 1 (a final softmax); None otherwise."""
    if h is None or h.kind != "classification":
        return None
    seen = []
    for ev in reversed(h.raw):
        z = holdout_logits_of(ev)
        if z is None:
            continue
        try:
            z = np.array(z, dtype=float)
        except (ValueError, TypeError, OverflowError):
            return None
        if z.ndim != 2 or z.shape[1] < 2 or not len(z) or not np.isfinite(z).all() or z.min() < 0 or z.max() > 1 \
                or np.abs(z.sum(axis=1) - 1).max() > 1e-3:
            return None
        seen.append(z.shape[1])
        if len(seen) == 3:
            return seen[0] if len(set(seen)) == 1 else None
    return None


def _binary_probability_outputs(h: Holdout):
    """The share of class 1 among the holdout's labels when a binary classifier's one output per example lies in
    [0, 1] at each of the last three evaluations (a final sigmoid); None otherwise."""
    if h is None or h.kind != "classification" or len(h.raw) < 3:
        return None
    for ev in h.raw[-3:]:
        p, y = _single_outputs(ev)
        if p is None or not np.all((p >= 0) & (p <= 1)):
            return None
    return float(np.mean(y))


def _binary_loss_floors(run: Run, share: float, least: float) -> tuple:
    """(train losses, the least BCEWithLogitsLoss gives each one's batch on probabilities, the share of class 1
    they saw): least for class 1, log 2 for class 0, mixed as each recorded batch's labels are (batch_stats),
    or as the holdout's (`share`) where the records hold no counts."""
    loss, st = column(run, "loss"), steps(run)
    s1 = np.full(len(loss), share)
    counts = _batch_counts(run)
    if counts is not None and "1" in counts[0]:
        names, m, size, at_steps = counts
        by_step = dict(zip(at_steps.tolist(), (m[:, names.index("1")] / np.maximum(size, 1)).tolist()))
        s1 = np.array([by_step.get(s, np.nan) for s in st.tolist()])
    keep = np.isfinite(loss) & np.isfinite(s1)
    s1 = s1[keep]
    return loss[keep], s1 * least + (1 - s1) * math.log(2), float(np.mean(s1)) if len(s1) else share


def check_softmax_over_batch(run: Run) -> list:
    """A classifier's (log-)softmax taken over the batch (dim=0) instead of the classes: an untrained model's
    logits are about equal, so its first train loss is the log of the batch size B where a loss over the K
    classes starts at log K, and the holdout's, scored over the classes from the same weights, does. Trained,
    that loss cannot fall below about log(B/K) (the batch's examples of a class share its column), so it
    stays over twice the holdout's while the holdout learns. The first train loss within 5% of log B, and 15%
    or more from log K with B and K apart, and the holdout's first loss within 15% of log K."""
    untrained, _ = _chance_losses(run)
    h = holdout_data(run)
    first = run.records[0] if run.records else {}
    size, loss0 = _get(first, ("batch_stats", "batch_size")), first.get("loss")
    if untrained is None or not (_has_type(size, int) and size >= 2 and _has_type(loss0, (int, float))):
        return []
    batch = math.log(size)
    pairs = _paired_losses(run, h)
    late_acc = _late(h, h.accuracy)
    if not (abs(batch - untrained) > 0.25 and abs(loss0 - batch) <= 0.05 * batch and abs(loss0 - untrained)
            >= 0.15 * untrained and len(pairs) >= 5 and abs(pairs[0, 1] - untrained) <= 0.15 * untrained
            and late_acc is not None and late_acc[0] >= 2 / h.num_classes):
        return []
    tail = pairs[-max(2, len(pairs) // 5):]
    train_late, holdout_late = float(np.median(tail[:, 0])), float(np.median(tail[:, 1]))
    if not train_late >= 2 * holdout_late:
        return []
    return [Finding(
        "softmax_over_batch", "warning",
        f"the train loss is normalised over the batch, not over the classes: it started at {_fmt(loss0)}, the log "
        f"of the batch size {size} ({_fmt(batch)}), where a loss over the {h.num_classes} classes starts at "
        f"{_fmt(untrained)}, as the holdout's did ({_fmt(pairs[0, 1])}); and it ends at {_fmt(train_late)}, "
        f"{train_late / holdout_late:.1f}x the holdout's {_fmt(holdout_late)} at the same weights.",
        _steps_list([int(first["step"])] if _has_type(first.get("step"), int) else []),
        hint="softmax or log_softmax with dim=0 over [batch, classes] outputs: use dim=-1 (or dim=1), or give "
             "CrossEntropyLoss the logits, which it normalises over the classes itself.")]


def check_probability_outputs(run: Run) -> list:
    """A model that ends in a softmax, trained with a loss that applies its own (CrossEntropyLoss): on
    probabilities of K classes that loss cannot go below log(1 + (K - 1) / e), the value of a one-hot output,
    so every batch's loss stays at or above it, and a model that has learned sits just above it with its
    gradients squashed. A loss that takes the log of the probabilities itself (NLLLoss) falls below it.
    The same for one output per example that ends in a sigmoid, trained with BCEWithLogitsLoss: on p in
    [0, 1] it gives class 1 at least log(1 + 1/e) (at p = 1) and class 0 at least log 2 (at p = 0), so a
    batch's loss never goes below the first, and a model that has learned sits near the labels' mix of the two.
    BCELoss, which takes the probabilities as they are, falls below both."""
    h = holdout_data(run)
    loss = _finite(column(run, "loss"))
    k, share = _probability_outputs(h), _binary_probability_outputs(h)
    if (k is None and share is None) or len(loss) < 5:
        return []
    if k is not None:
        floor = least = math.log1p((k - 1) / math.e)
        floors = np.full(len(loss), floor)
        what = (f"the model's outputs are probabilities (every holdout row of the last three evaluations lies in "
                f"[0, 1] and sums to 1), and the train loss never went below {_fmt(floor)}, the least "
                f"CrossEntropyLoss gives on probabilities of {k} classes (a one-hot output)")
        cause = "the loss applies a softmax to outputs that already had one"
        hint = ("Drop the final Softmax and give CrossEntropyLoss the logits (it applies log-softmax itself); or keep "
                "probabilities for inference and train on LogSoftmax outputs with NLLLoss. The holdout's loss in these "
                "records takes the outputs as logits too.")
    else:
        least = math.log1p(1 / math.e)
        loss, floors, share = _binary_loss_floors(run, share, least)
        floor = _edge_median(floors, "last")
        what = (f"the model's one output per example is a probability (the holdout's outputs lie in [0, 1] at the last "
                f"three evaluations), and the train loss never went below {_fmt(least)}, the least BCEWithLogitsLoss "
                f"gives class 1 on a probability (class 0 gets at least {_fmt(math.log(2))}); for the batches' mix of "
                f"labels ({_fmt(share)} of class 1) that is {_fmt(floor)}")
        cause = "the loss applies a sigmoid to outputs that already had one"
        hint = ("Drop the final Sigmoid and give BCEWithLogitsLoss the logits (it applies the sigmoid itself); or keep "
                "the sigmoid and train with BCELoss.")
    # each batch's loss against its own floor (the mix of its labels, for one output), over the last records;
    # a model that gets most of the holdout right while its loss stays this near that floor is squashed there
    # too (one trained on log-probabilities, right as often, scores far below it)
    late_acc = _late(h, h.accuracy) if k is not None else None
    near = 1.25 if late_acc is not None and late_acc[0] >= 0.5 else 1.1
    if len(loss) < 5 or loss.min() < least * (1 - 1e-4) or _edge_median(loss / floors, "last") > near:
        return []
    late = _edge_median(loss, "last")
    st = steps(run)
    return [Finding("probability_outputs", "warning",
                    f"{what}, ending at {_fmt(late)}: {cause}, which caps it there and squashes the gradients.",
                    _steps_list([st[0], st[-1]]), hint=hint)]


def _standing_still(run: Run, g: str):
    """([evidence], [first steps]) that group g does not move while the other groups do: its gradient 0 or
    absent, or its weight delta 0, in >= 80% of the collections after the first."""
    evidence, where = [], []
    later = np.arange(len(run.records)) >= 1   # the first collection: no weight reference; LoRA A starts at 0
    for section, absent_counts in (("gradient_norm", True), ("weight_delta", False)):
        others = [column(run, (section, k)) for k in _groups(run, section) if k != g]
        if not others:
            continue
        with np.errstate(invalid="ignore"):
            others_move = np.any(np.vstack(others) > 0, axis=0)   # nobody moving is not this group's problem
        v = column(run, (section, g))
        mask = later & present(run, section) & others_move & ~nonfinite_at(run, f"{section}.{g}")
        if not absent_counts:
            mask &= ~np.isnan(v)
        zero = mask & (np.isnan(v) | (v == 0))
        considered, nzero = int(mask.sum()), int(zero.sum())
        if considered >= 2 and nzero >= 0.8 * considered:
            what = "gradient was 0 or absent" if section == "gradient_norm" else "weight delta was 0"
            evidence.append(f"its {what} in {nzero} of {considered} collections")
            where.append(int(steps(run)[zero][0]))
    return evidence, where


def _layer_of(name: str) -> str:
    """The grad_profile layer of a parameter, as telemetry.py's layer_key names it: its name up to the first
    numeric segment (a block index), else its module."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i + 1])
    return ".".join(parts[:-1]) or name


def _layers_without_gradient(run: Run):
    """(layers, the layers that had a gradient, collections considered, first step) for the grad_profile layers
    whose gradient was absent (null, and not for a NaN) in every collection where some other layer had one;
    None where there are none, or fewer than 3 such collections to tell."""
    never, reached, considered, first = None, {}, 0, None
    for r in run.records:
        prof = r.get("grad_profile")
        if not isinstance(prof, dict):
            continue
        with_grad = [k for k, v in prof.items() if _num(v) > 0]
        if not with_grad:
            continue   # no gradient anywhere: the hook ran after zero_grad (missing_gradients' finding)
        nonfinite = {_text(p) for p in r.get("nonfinite") or []} if isinstance(r.get("nonfinite"), list) else set()
        null = {k for k, v in prof.items() if v is None and f"grad_profile.{k}" not in nonfinite}
        # A layer absent from a record (another model after a restart) or with a gradient in it drops out:
        # a head trained on every other batch has none on half the steps, and is no finding.
        never = null if never is None else never & null
        reached.update(dict.fromkeys(with_grad))
        considered += 1
        first = r["step"] if first is None else first
    if not never or considered < 3:
        return None
    layers = [k for k in section_keys(run, "grad_profile", skip_overall=False) if k in never]
    return layers, list(reached), considered, first


def _gradless_layers(run: Run, covered: set):
    """frozen_group for the layers that never get a gradient inside groups that do (a backbone whose output is
    detached before the head, in one optimizer group with it): the group as a whole moves, so its own numbers
    hide them. Groups in `covered` have a finding of their own."""
    found = _layers_without_gradient(run)
    if found is None:
        return None
    layers, reached, considered, first = found
    owner = {}
    for g, info in _meta_groups(run).items():
        for n in info.get("names") or []:
            if isinstance(n, str):
                owner.setdefault(_layer_of(n), set()).add(g)
    if covered:   # a layer of a group already reported, or one whose group run.json does not name, is left out
        layers = [k for k in layers if owner.get(k) and not owner[k] <= covered]
    if not layers:
        return None
    groups = set().union(*(owner.get(k, set()) for k in layers))
    group = next(iter(groups)) if len(groups) == 1 else None
    # Only the input side: standing still there is the whole feature extractor, and the model learns only on
    # top of its initial weights. A head without a gradient in every record may be one trained on the other
    # batches of a multi-task loop, which collections at every even step never see.
    if layers[0] != section_keys(run, "grad_profile", skip_overall=False)[0]:
        return None
    return Finding(
        "frozen_group", "critical",
        f"{len(layers)} layer(s) ({', '.join(layers[:6])}{', ...' if len(layers) > 6 else ''}) got no gradient at "
        f"all (null in the gradient profile) in all {considered} collections where other layers had one "
        f"({', '.join(reached[:3])}{', ...' if len(reached) > 3 else ''}), so the optimizer never changes them"
        + (f"; the rest of their group '{group}' trains" if group else "") + ".",
        [int(first)], group=group,
        hint="The loss does not reach them: look in forward for a detach(), torch.no_grad() or .data between them "
             "and the output, or a module forward never calls; if they are meant to stay fixed, freeze them "
             "(requires_grad_(False)) or leave them out of the optimizer.")


def check_frozen_groups(run: Run) -> list:
    """A group whose weights never move while the others do, for a reason the records do not name (those
    they name have their own findings: lr_zero, frozen_parameters, not_in_optimizer); or layers inside a
    group that never get a gradient while the rest of it does."""
    groups = list(dict.fromkeys(_groups(run, "gradient_norm") + _groups(run, "weight_delta") + list(_meta_groups(run))))
    # Where no weight moves at all (every lr 0, say), no group stands still while the others train
    moved = _finite(column(run, "weight_delta.overall")[1:])
    if len(moved) and not (moved > 0).any():
        groups = []
    lr_zero = _lr_zero_groups(run) if len(groups) >= 2 else {}
    findings = []
    for g in groups if len(groups) >= 2 else []:
        if g in lr_zero or _outside_optimizer(run, g) or _wholly_frozen(run, g):
            continue
        evidence, where = _standing_still(run, g)
        if evidence:
            findings.append(Finding(
                "frozen_group", "critical",
                f"group '{g}' does not train while the other groups do: " + " and ".join(evidence) + ".",
                sorted(where), group=g,
                hint="Check requires_grad on that group's parameters, that they are in the optimizer, and that "
                     "forward uses them without detach()/torch.no_grad(); after a blow-up, dead ReLUs also give "
                     "zero gradients."))
    layers = _gradless_layers(run, {f.group for f in findings})
    return findings + ([layers] if layers else [])


def _steps_covered(run: Run) -> np.ndarray:
    """Per record, the optimizer steps its weight change covers: step - reference_step, or the gap to the
    previous record for writers that did not say; NaN where unknown."""
    st = steps(run)
    ref = column(run, "reference_step")
    prev = np.concatenate([[np.nan], st[:-1]])
    gap = np.where(np.isfinite(ref), st - ref, st - prev)
    return np.where(gap >= 1, gap, np.nan)


# Healthy training moves the weights around 1e-3 of their norm per step (Karpathy's rule of thumb); the
# slowest corpus run that learned moved 5e-5. 1e-5 per step is two orders below the rule: at that pace the
# weights need 100,000 steps to change by their own size.
STILL_PACE = 1e-5


def _weights_barely_move(run: Run):
    """(True/False/None, explanation): do the weights move less than STILL_PACE of their norm per optimizer
    step? None = cannot tell."""
    gap = _steps_covered(run)[1:]
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        relative = column(run, "weight_delta.overall") / column(run, "weight_norm.overall")
    for label, ratio in (("update ratio ||dW||/||W||", column(run, "update_ratio.overall")[1:]),
                         ("relative weight change", relative[1:])):
        pace = _finite(ratio / gap)
        if len(pace) >= 3:
            med = float(np.median(pace))
            return med < STILL_PACE, f"median {label} {_fmt(med)} per optimizer step"
    wd = _finite(column(run, "weight_delta.overall")[1:])
    if len(wd) >= 2 and np.all(wd == 0):
        return True, "no weight changed at all"
    trainable = _get(run.meta, ["parameters", "trainable"])
    rms = _finite(column(run, "weight_delta.overall")[1:] / gap) / math.sqrt(trainable) \
        if isinstance(trainable, int) and trainable > 0 else np.array([])
    if len(rms) >= 3:   # no weight norms: weights are typically ~1e-2..1e-1, so 1e-8 RMS is far below STILL_PACE
        med = float(np.median(rms))
        return med < 1e-8, f"median RMS change per weight {_fmt(med)} per optimizer step"
    return None, ""


@dataclass
class LossTrend:
    """The train loss at the start and the end of the run (medians of its first and last fifths), the
    standard error of their difference (from the batch-to-batch noise), and its highest value."""
    first: float
    last: float
    se: float
    where: list      # the first and last step
    peak: float
    peak_step: int


def _noise_sd(x: np.ndarray, lag: int = 1) -> float:
    """Robust standard deviation of one value of a noisy series: the MAD of successive differences over
    sqrt(2), so that a trend does not pass for noise. With a lag, of the changes over that many values: a
    series sampled at every step wanders slowly, and its successive differences miss how far."""
    d = x[lag:] - x[:-lag]
    return 1.4826 * float(np.median(np.abs(d - np.median(d)))) / math.sqrt(2) if len(d) else 0.0


def _loss_trend(run: Run):
    loss = column(run, "loss")
    ok = np.isfinite(loss)
    x, st = loss[ok], steps(run)[ok]
    if len(x) < 6:
        return None
    k = max(3, int(math.ceil(0.2 * len(x))))
    # The batch-to-batch noise of the whole series (a fifth of a short run is too few points, and its
    # steep start would pass for noise); the standard error of a median is ~1.2533 sigma / sqrt(k).
    se = 1.2533 * _noise_sd(x) * math.sqrt(2 / k)
    i = int(np.argmax(x))
    return LossTrend(float(np.median(x[:k])), float(np.median(x[-k:])), se, [int(st[0]), int(st[-1])],
                     float(x[i]), int(st[i]))


def _flat(t: LossTrend) -> bool:
    """The train loss did not fall beyond its noise (3 standard errors), nor by 1%."""
    return t.first - t.last < max(3 * t.se, 0.01 * abs(t.first))


def _at_chance_level(t: LossTrend, prior: float) -> bool:
    """The train loss ends at `prior` (the level of a model that knows only the label shares), within 3
    standard errors or a tenth of it."""
    return abs(t.last - prior) <= max(3 * t.se, 0.1 * prior)


def _trend_text(t: LossTrend) -> str:
    return (f"median {_fmt(t.first)} over the first fifth of the run and {_fmt(t.last)} over the last "
            f"({_change_text(t.first, t.last)}; the noise allows +/-{_fmt(3 * t.se)})")


def _change_text(a: float, b: float) -> str:
    if a > 0 and b >= 2 * a:
        return f"{b / a:.1f}x as high"
    return f"{'fell' if b < a else 'rose'} {abs(b - a) / abs(a):.1%}" if a else f"from {_fmt(a)} to {_fmt(b)}"


def _prior_model(run: Run) -> str:
    """What the chance level of _chance_losses predicts, in words."""
    h = holdout_data(run)
    return "the targets' mean for every example" if h and h.kind == "regression" else "only the label shares"


def _chance_losses(run: Run):
    """(untrained, prior): the loss of a fresh classifier (log K: its logits are ~0) and that of a model that
    knows only the label shares (the entropy of the train batches' labels, lower for unbalanced data; for a
    regression, the variance of the targets, what predicting their mean scores); None where the run does
    not say."""
    h = holdout_data(run)
    if h and h.kind == "regression":   # an untrained regressor predicts ~0, not the mean: no untrained level
        targets = _last_targets(h)
        return None, (_mean_variance(targets) if len(targets) >= 5 else None)
    if not (h and h.kind == "classification" and h.num_classes and h.num_classes >= 2):
        return None, None
    bc = _batch_counts(run)
    shares = bc[1].sum(axis=0) / bc[1].sum() if bc and bc[1].sum() > 0 else np.array([])
    shares = shares[shares > 0]
    prior = float(-(shares * np.log(shares)).sum()) if len(shares) >= 2 else math.log(h.num_classes)
    return math.log(h.num_classes), min(prior, math.log(h.num_classes))


# A classifier's train loss under this share of log K (an untrained model's) within the first fifth of the
# run, while its holdout gets only worse, is not the loss of its predictions against the labels.
NEAR_ZERO_SHARE = 0.05


def check_train_loss_near_zero(run: Run) -> list:
    """A classifier's train loss that starts under a third of the holdout's cross-entropy at the same weights
    and falls to near 0 within the first fifth of the collections while that cross-entropy never falls below
    where it began and ends the fifth above an untrained model's (log K), and the holdout ends at chance: the
    loss the model minimises does not score its predictions against the labels. A focal loss whose weight is inverted (p^gamma for (1 - p)^gamma)
    makes every confident prediction nearly free, right or wrong; so does a loss masked or scaled to nearly
    nothing. A model that learns lowers both losses at first, and one that memorises its training set gets
    its train loss near 0 only later."""
    untrained, _ = _chance_losses(run)
    h = holdout_data(run)
    if untrained is None or not h:
        return []
    pairs = _paired_losses(run, h)
    if len(pairs) < 10:
        return []
    early = pairs[:max(3, int(math.ceil(0.2 * len(pairs))))]
    tr, ho = early[:, 0], early[:, 1]
    low = float(np.median(tr[-3:]))
    # At the first collection the model has learned next to nothing, and a cross-entropy on a batch reads
    # about what it reads on the holdout: a third of it is a loss of something else (a model that memorises
    # its training set starts where the holdout does).
    # ... and it falls (a loss that is 0 throughout, multiplied by 0, is not_learning's), while the holdout's
    # only rises
    if not (0 <= low < NEAR_ZERO_SHARE * untrained and 0 < tr[0] < ho[0] / TRAIN_SCALE and low <= 0.5 * tr[0]
            and ho.min() >= 0.9 * ho[0] and ho[-1] > max(untrained, 1.2 * ho[0])) \
            or not check_holdout_at_chance(run) or check_holdout_off_scale(run):
        return []
    return [Finding(
        "train_loss_near_zero", "critical",
        f"the train loss fell to {_fmt(low)} by step {int(early[-1, 2])} from {_fmt(float(tr[0]))} (a "
        f"{_fmt(float(ho[0] / tr[0]))}th of the holdout's cross-entropy at the first collection), near 0, "
        f"while the holdout's cross-entropy at the same weights only rose, from {_fmt(float(ho[0]))} to "
        f"{_fmt(float(ho[-1]))}, above the {_fmt(untrained)} of an untrained classifier: what the model "
        "minimises does not score its predictions against the labels, and the holdout ends at chance.",
        _steps_list([int(early[0, 2]), int(early[-1, 2])]),
        hint="Check the loss function: a focal loss weights each example by (1 - p)^gamma, p the probability of "
             "its label (p^gamma makes every confident mistake free); a mask or a factor that leaves almost "
             "nothing of the loss; the loss passed to on_batch_end being another than the one trained on.")]


def check_negative_loss(run: Run) -> list:
    """A classifier's train loss below 0, and on down without bound: cross-entropy on probabilities is never
    negative, but NLLLoss on raw outputs (it expects log-probabilities) is -output[label], and binary
    cross-entropy against a target above 1 (labels 1 and 2) falls without end as the logit grows: the model
    lowers them by growing its outputs until they overflow. The lowest finite loss is under 0 and 10 times as far
    from 0 as the first fifth's median (or 1, if more), in a run with class labels (batch counts or a
    holdout); a run that reached NaN counts its finite losses before it. Or the loss is below 0 from the first
    collection on, at every value, and not rising toward 0: a divergence between class distributions given
    probabilities where it expects log-probabilities is never above 0, and falls further as the model learns. A
    policy gradient's loss, -advantage x log-probability, is below 0 too, but rises toward 0 as the policy
    settles. A run without classes: see _loss_without_floor."""
    h = holdout_data(run)
    classes = h is not None and h.kind == "classification" or bool(section_keys(run, "batch_stats.counts",
                                                                                 skip_overall=False))
    loss = column(run, "loss")
    ok = np.isfinite(loss)
    x, st = loss[ok], steps(run)[ok]
    if not classes:
        return _loss_without_floor(x, st)
    if len(x) < 3:
        return []
    first = float(np.median(x[:max(1, len(x) // 5)]))
    i = int(np.argmin(x))
    hint = ("Use F.cross_entropy on the logits, or F.nll_loss on log_softmax(logits): nll_loss expects "
            "log-probabilities, and so does the input of KLDivLoss / F.kl_div (distillation: "
            "F.kl_div(F.log_softmax(student / T, -1), F.softmax(teacher / T, -1), reduction='batchmean')). Binary "
            "targets must be 0 and 1 (labels 1 and 2 minus 1). And check the loss's sign: minus a cross-entropy "
            "falls without end too, as the model learns to avoid the right class.")
    below = int((x < 0).sum())
    t = _loss_trend(run)
    rising = t is not None and t.last > t.first + 3 * t.se
    if x[i] >= -10 * max(abs(first), 1.0) and len(x) >= 5 and below == len(x) and not rising:
        # Below 0 from the first collection, and staying there: no fall to see, but a cross-entropy, a KL
        # divergence or a focal loss of class probabilities cannot be negative at all.
        return [Finding(
            "negative_loss", "critical",
            f"the train loss of a classifier is below 0 at every one of its {len(x)} finite values, from the first "
            f"(a median {_fmt(first)} over the first fifth, {_fmt(float(x[i]))} at its lowest). A loss on class "
            "probabilities is never negative: cross-entropy, KL divergence and focal loss are 0 at best. KLDivLoss "
            "(F.kl_div) given probabilities where it expects log-probabilities is, and so is NLLLoss on raw "
            "outputs.", _steps_list([st[0], st[i]]), hint=hint)]
    if not x[i] < -10 * max(abs(first), 1.0):
        return []
    return [Finding(
        "negative_loss", "critical",
        f"the train loss of a classifier fell below 0 and on without bound: from a median {_fmt(first)} over the "
        f"first fifth of its finite values to {_fmt(float(x[i]))} at step {int(st[i])}. A loss on class "
        "probabilities is never negative. NLLLoss on raw outputs (minus the label's output) is, and so is binary "
        "cross-entropy against targets above 1: the model lowers them by growing its outputs without end.",
        _steps_list([st[0], st[i]]), hint=hint)]


UNBOUNDED = 1e6   # a loss this many times as far below 0 as it started (from above 0, or from 1) has no floor


def _loss_without_floor(x: np.ndarray, st: np.ndarray) -> list:
    """negative_loss for any loss, not a classifier's: one that started above 0 and fell below 0 by UNBOUNDED
    times its first value (a run that reached NaN counts its finite losses before it). A regression's or an
    autoencoder's loss, a likelihood's even, never goes that far on its own: a term added with the wrong sign
    (a VAE's KL divergence subtracted) lets the model drive it down without end."""
    if len(x) < 3 or not x[0] > 0:
        return []
    i = int(np.argmin(x))
    if not x[i] < -UNBOUNDED * max(float(x[0]), 1.0):
        return []
    below = int(np.argmax(x < 0))
    return [Finding(
        "negative_loss", "critical",
        f"the train loss fell below 0 and on without bound: {_fmt(float(x[0]))} at the first collection, below 0 "
        f"from step {int(st[below])}, {_fmt(float(x[i]))} at step {int(st[i])}. The objective has no floor, and the "
        "model drives it down by growing its outputs or weights, not by fitting the data.",
        _steps_list([st[0], st[below], st[i]]),
        hint="Check the sign of each term of the loss: a term to minimise that is subtracted (a VAE's KL divergence, "
             "a penalty) or one to maximise that is added; a log-likelihood whose variance may shrink to 0 needs a "
             "floor on it.")]


COPIED = 0.8   # a language model whose top prediction is the token at its own position this often copies its input
COPY_MARGIN = 0.3   # ... when that is this far above how often it predicts the next token


def check_future_visible(run: Run) -> list:
    """A language model whose predictions before the last position changed when telemetry changed only the
    last input token (sees_future in the holdout's records, probed once at its first evaluation): each
    position sees the tokens after it, the one it predicts among them. Its train and holdout losses are
    those of a model that reads the answer; generating, it has no answer to read."""
    h = holdout_data(run)
    seen = [r.get("sees_future") for r in h.raw] if h and h.kind == "lm" else []
    if True not in seen:
        return []
    st = steps(run)
    entropy, late = _get(run.meta, ["holdout", "token_entropy"]), _late(h, h.loss)
    below = (f" Its holdout loss, {_fmt(late[0])} nats a token, is what reading the next token gives"
             + (f" (the tokens' own frequencies give {_fmt(entropy)})" if _has_type(entropy, (int, float)) else "")
             + ": it says nothing of how the model predicts." if late else "")
    return [Finding(
        "future_visible", "critical",
        "the model sees the tokens it is to predict: changing only the last input token of the holdout's first "
        "batch changed its predictions at the positions before it, which a causal language model's cannot." + below,
        _steps_list([int(st[0])]),
        hint="Mask the attention causally: nn.TransformerEncoder(..., mask=nn.Transformer."
             "generate_square_subsequent_mask(T), is_causal=True), is_causal=True in scaled_dot_product_attention, "
             "or a decoder-only model's own causal mask; a bidirectional layer (a bidirectional RNN, a convolution "
             "that is not causally padded) reads ahead too.")]


# Two forwards over the same batch in eval() mode differ by float rounding at most: the typical example's
# outputs moved by 1% of its largest is no rounding (a bf16 ulp is 0.4% of a number; telemetry takes the median
# over the examples, so the few outputs a kernel that is not deterministic rounds otherwise do not count).
PROBE_CHANGE = 1e-2


def _eval_probe(run: Run):
    """(step, {"repeat", "reorder"}) of the holdout's first eval_probe (telemetry's order_probe, at its first
    evaluation), or None."""
    h = holdout_data(run)
    for step, raw in zip(h.steps, h.raw) if h else ():
        probe = raw.get("eval_probe") if isinstance(raw, dict) else None
        if isinstance(probe, dict) and all(_has_type(probe.get(k), (int, float)) for k in ("repeat", "reorder")):
            return int(step), probe
    return None


def check_eval_random(run: Run) -> list:
    """Outputs that change between two eval() passes over the same batch, the weights unchanged: something
    random stays on at evaluation (F.dropout defaults to training=True), so every evaluation is noisy and
    pessimistic."""
    found = _eval_probe(run)
    if found is None or not found[1]["repeat"] > PROBE_CHANGE:
        return []
    step, probe = found
    return [Finding(
        "eval_random", "warning",
        f"the model's outputs in eval() mode are random: a second pass over the holdout's first batch, the weights "
        f"unchanged, moved them by {_fmt(100 * probe['repeat'])}% of each example's largest output (the median "
        "example). Something that draws random numbers stays on at evaluation, so the holdout's scores, and any "
        "evaluation or prediction, are noisy and worse than the model.", _steps_list([step]),
        hint="F.dropout(x, p) defaults to training=True: pass training=self.training (so do F.dropout1d/2d/3d and "
             "F.alpha_dropout), or use nn.Dropout modules, which model.eval() turns off; noise added in forward() "
             "(torch.randn_like) belongs under `if self.training:`.")]


def check_examples_mixed(run: Run) -> list:
    """Outputs that change when the other examples of the batch come in another order (eval() mode, the
    weights unchanged, each pass repeatable): the model mixes examples along the batch axis, as an RNN fed
    [batch, time, ...] without batch_first=True does."""
    found = _eval_probe(run)
    if found is None or found[1]["repeat"] > PROBE_CHANGE or not found[1]["reorder"] > PROBE_CHANGE:
        return []
    step, probe = found
    return [Finding(
        "examples_mixed", "warning",
        f"each example's outputs depend on the other examples in its batch: in eval() mode, the weights unchanged, "
        f"the holdout's first batch given in reverse order moved them by {_fmt(100 * probe['reorder'])}% of each "
        "example's largest output (the median example), where a second pass in the same order did not. The model "
        "mixes examples along the batch axis: a prediction depends on what else is in the batch, and in what "
        "order.", _steps_list([step]),
        hint="nn.LSTM, nn.GRU and nn.RNN take [time, batch, features] unless batch_first=True: pass batch_first=True "
             "for [batch, time, features] inputs. Otherwise look for a .view() or .reshape() that moves the batch "
             "axis (.permute() or .flatten(1) keep it), or an operation over dim 0.")]


# A forward that masks its padding scores a row's tokens alike in a padded batch and alone, to rounding (in
# float32, to the last digits; bf16 kernels that batch otherwise move a row's mean NLL by some 0.1%). The median
# evaluation's row off by 1% reads its padding; 0.1% where telemetry saw the forward run wholly in float32 or
# wider, whose rounding is thousands of times smaller, while a model that reads a few positions of padding may
# move its row by under 1%.
PADDING_CHANGE = 1e-2
PADDING_CHANGE_FULL_PRECISION = 1e-3


def check_padding_read(run: Run) -> list:
    """A language model whose holdout row with the most padding scores its tokens otherwise than the same row
    alone, unpadded (telemetry's padding_probe, at each evaluation): its forward reads the padding as context
    (a left-padded batch through attention that ignores attention_mask), so every score of a padded batch
    measures the padding too."""
    h = holdout_data(run)
    seen = []
    for step, raw in zip(h.steps, h.raw) if h else ():
        pair = raw.get("padding_nll") if isinstance(raw, dict) else None
        if isinstance(pair, list) and len(pair) == 2 and all(_has_type(v, (int, float)) and math.isfinite(v)
                                                             for v in pair) and pair[1] > 0:
            seen.append((int(step), pair, raw.get("padding_positions"), raw.get("padding_full_precision") is True))
    changes = [abs(pair[0] - pair[1]) / pair[1] for _, pair, _, _ in seen]
    limit = PADDING_CHANGE_FULL_PRECISION if seen and all(full for *_, full in seen) else PADDING_CHANGE
    if not changes or not float(np.median(changes)) > limit:
        return []
    step, (padded, alone), positions, _ = seen[-1]
    shares = column(run, "batch_stats.padding_share")
    shares = shares[np.isfinite(shares)]
    trained = (f" The training batches are {_fmt(100 * float(shares.mean()))}% padding: if they go through the same "
               "forward, training reads it too, and the model learns text that is not there."
               if len(shares) and shares.mean() > 0 else "")
    many = f"{positions} positions of padding" if _has_type(positions, int) else "padding"
    return [Finding(
        "padding_read", "warning",
        f"the model's outputs depend on padding: the holdout's row with the most padding ({many}) scores its "
        f"tokens at a mean NLL of {_fmt(padded)} in its batch and {_fmt(alone)} alone, unpadded, at step {step} "
        f"(the median evaluation {_fmt(100 * float(np.median(changes)))}% apart, where a forward that masks its "
        "padding differs by rounding). Its attention reads the padding as context, or its positions count it; "
        "the holdout's scores measure the padding as well as the model." + trained,
        _steps_list([s for s, *_ in seen]),
        hint="Pass attention_mask through to the attention (a wrapper's forward that drops it lets every position "
             "read the padding). With learned absolute positions (GPT-2), left padding also moves the text's "
             "positions: pass position_ids counted from each row's first token, or pad on the right "
             "(tokenizer.padding_side = \"right\" before tokenizing the holdout and the training text).")]


def _late_beside_next_token(run: Run, key: str):
    """(_late of a language model holdout's per-evaluation `key`, a share of its positions; _late of its
    next-token accuracy; the positions its last evaluation counted), or None where either has too few
    evaluations or under 50 positions were counted."""
    h = holdout_data(run)
    if not h or h.kind != "lm":
        return None
    shares = np.array([_num(r.get(key)) for r in h.raw])
    tokens = h.raw[-1].get("tokens") if h.raw else None
    counted = sum(v for v in tokens if _has_type(v, int)) if isinstance(tokens, list) else 0
    late, late_next = _late(h, shares), _late(h, h.accuracy)
    return None if late is None or late_next is None or counted < 50 else (late, late_next, counted)


def check_labels_not_shifted(run: Run) -> list:
    """A language model that predicts the token at each position, not the next one: trained on labels that
    were never shifted (logits[:, t] scored against labels[:, t]), it learns to copy its input, its train loss
    falls toward 0, and the holdout, scored on the next token, gets worse than an untrained model's. Telemetry
    records the share of holdout positions whose top prediction is the position's own token (copy_accuracy);
    over the last quarter of the evaluations it is COPIED or more, and three times the next-token accuracy or
    COPY_MARGIN above it: in text whose tokens often repeat (source code's indentation) a model that copies is
    right at the next token a third of the time, where a model trained right predicts its own token about as
    often as the next one is that token."""
    found = _late_beside_next_token(run, "copy_accuracy")
    if found is None:
        return []
    late_copy, late_next, counted = found
    if late_copy[0] < COPIED or (late_copy[0] < 3 * late_next[0] and late_copy[0] - late_next[0] < COPY_MARGIN):
        return []
    return [Finding(
        "labels_not_shifted", "critical",
        f"the model predicts the token at each position rather than the next one: over the holdout's last "
        f"evaluations (steps {late_copy[1]}-{late_copy[2]}) its top prediction is the input token at the same "
        f"position for {late_copy[0]:.0%} of {counted} positions, and the next token for {late_next[0]:.0%}. The "
        "training loss scores each position against its own token (labels not shifted), so the model learns to "
        "copy its input: its train loss falls toward 0 while its next-token loss grows.",
        _steps_list([late_copy[1], late_copy[2]]),
        hint="Score logits[:, :-1] against labels[:, 1:] in the loss, or pass labels=input_ids to a Hugging Face "
             "causal LM, which shifts them itself (and does not want them shifted already). A seq2seq decoder "
             "whose input is its targets as they are sees each answer as it predicts it: feed it the targets "
             "shifted right (a start token, then targets[:, :-1]).")]


def check_labels_shifted_twice(run: Run) -> list:
    """A language model that predicts the token after the next one: trained on labels shifted already and
    handed to a model that shifts them again (labels=input_ids[:, 1:] for a Hugging Face causal LM), each
    position learns the token two places on. Where the holdout's labels are the tokens of its text, telemetry
    records the share of positions whose top prediction is the token after the one scored (ahead_accuracy);
    a model trained right gets the next token more often than the one after it, by far. Over the last quarter
    of the evaluations it is above the next-token accuracy by 3 binomial sigmas of the positions counted and
    by 3 points or more."""
    found = _late_beside_next_token(run, "ahead_accuracy")
    if found is None:
        return []
    late_ahead, late_next, counted = found
    gap = late_ahead[0] - late_next[0]
    if gap < 0.03 or gap < 3 * math.sqrt(max(late_ahead[0] * (1 - late_ahead[0]), 1e-9) / counted):
        return []
    return [Finding(
        "labels_shifted_twice", "critical",
        f"the model predicts the token after the next one: over the holdout's last evaluations (steps "
        f"{late_ahead[1]}-{late_ahead[2]}) its top prediction is that token at {late_ahead[0]:.0%} of the positions, "
        f"and the next token, which it is scored on, at {late_next[0]:.0%} of {counted}. The labels were shifted "
        "twice: shifted already, then by a model or loss that shifts them again.",
        _steps_list([late_ahead[1], late_ahead[2]]),
        hint="A Hugging Face causal LM shifts its labels itself: pass labels=input_ids (the same tensor), not "
             "input_ids[:, 1:]; in a loss of your own, score logits[:, :-1] against labels[:, 1:] once.")]


PINNED = 0.9   # the share of collections at one gradient norm that says clipping acts at every step


def check_gradients_clipped(run: Run) -> list:
    """Gradients clipped to a norm so small that the run learns nothing: the total gradient norm, read after
    clip_grad_norm_, is the same number (to 1 part in 1000) at PINNED or more of the collections, and the
    train loss never fell. Clipping at every step is common and harmless in a run that learns (the loss
    falls): only a run that does not learn is told, and only with SGD, whose step scales with the gradient
    (Adam's and its kin's do not, so clipping cannot hold them back)."""
    st, g, _ = _grad_series(run)
    t = _loss_trend(run)
    if "SGD" not in str(run.meta.get("optimizer")) or g is None or len(g) < 6 or t is None or not _flat(t):
        return []
    level = float(np.median(g))
    pinned = np.abs(g / level - 1) < 1e-3
    if pinned.mean() < PINNED:
        return []
    return [Finding(
        "gradients_clipped", "warning",
        f"the total gradient norm is {_fmt(level)} at {int(pinned.sum())} of {len(g)} collections, to 1 part in "
        f"1000: the gradients are clipped to that norm at every step (clip_grad_norm_'s max_norm), and the train "
        f"loss never fell: {_trend_text(t)}. Steps that small leave the weights where they started.",
        _steps_list(st[pinned][:1]),
        hint="Raise max_norm (1.0 is usual) or remove the clipping: clipped at every step, each step's size is "
             "the learning rate times max_norm, whatever the loss.")]


WEIGHTS_COLLAPSED = 5.0   # the weights' norm fell this many times over the run while the loss learned nothing


def check_weights_collapsed(run: Run) -> list:
    """The weights shrink toward 0 while the train loss learns nothing: a pull toward 0 stronger than the
    loss's gradient (weight_decay that SGD or Adam add to every gradient, or an L2 penalty in the loss)
    leaves a network whose outputs barely depend on its inputs. Its norm falls WEIGHTS_COLLAPSED times or
    more from the first collection to the last fifth of the run, and the train loss ends at the level of a
    model that knows only the label shares (or, where the run does not say that level, never fell)."""
    norm, st = column(run, "weight_norm.overall"), steps(run)
    ok = np.isfinite(norm)
    norm, st = norm[ok], st[ok]
    t = _loss_trend(run)
    if len(norm) < 6 or t is None or not norm[0] > 0:
        return []
    last = float(np.median(norm[-max(3, int(math.ceil(0.2 * len(norm)))):]))
    if last * WEIGHTS_COLLAPSED > norm[0]:
        return []
    _, prior = _chance_losses(run)
    if prior is not None:
        if not _at_chance_level(t, prior):
            return []   # it learned something: a smaller norm that still fits the data
        level = f"ended at the chance level ({_fmt(t.last)} over the last fifth, against {_fmt(prior)} for a " \
                f"model that predicts {_prior_model(run)})"
    elif _flat(t):
        level = f"never fell ({_trend_text(t)})"
    else:
        return []
    below = int(st[np.argmax(norm * WEIGHTS_COLLAPSED <= norm[0])])
    optimizer = run.meta.get("optimizer") or "the optimizer"
    return [Finding(
        "weights_collapsed", "critical",
        f"the weights shrank toward 0: their norm fell from {_fmt(norm[0])} at the first collection to "
        f"{_fmt(last)} over the last fifth of the run (under a fifth of it from step {below} on), while the train "
        f"loss {level}. Something pulls the weights to 0 harder than the loss's gradient pushes them out: the "
        f"weight_decay that {optimizer} adds to every gradient, or an L2 penalty in the loss; a network with "
        "weights near 0 outputs about the same for every input.", _steps_list([st[0], below]),
        hint="Lower weight_decay (SGD and Adam add weight_decay x w to the gradient: 1e-4 to 5e-4 is usual there; "
             "AdamW applies it apart from the gradient), or the L2 penalty's factor.")]


def check_not_learning(run: Run) -> list:
    """The weights do not move (or barely), and the loss does not fall."""
    hint = ("Check that optimizer.step() is called, that the optimizer holds the model's parameters, and the "
            "learning rate (try 10-100x larger).")
    wd = _finite(column(run, "weight_delta.overall")[1:])
    if len(wd) >= 2 and np.all(wd == 0):
        why = f"no weight changed in any of the {len(wd)} collections after the first"
        grads, loss = column(run, "gradient_norm.overall"), _finite(column(run, "loss"))
        if len(grads) >= 2 and np.all(grads == 0):  # recorded as 0, not null: the gradients were there
            why += (", and every gradient was exactly 0 at every collection" +
                    (", as was the train loss" if len(loss) and np.all(loss == 0) else ""))
            hint = ("The loss does not depend on the weights: check what it is computed from (a loss multiplied by 0, "
                    "or by a mask or per-example weights that select nothing).")
            if len(loss) >= 2 and np.all(loss != 0) and np.ptp(loss) > 0:
                why += f", while the train loss was there ({_fmt(float(np.median(loss)))}, varying by batch)"
                hint = ("Something sets the gradients to 0 after backward(): clip_grad_norm_ with max_norm=0 (a "
                        "config's 0 meant as 'no clipping': clip only when it is > 0), a grad.zero_() or a hook that "
                        "scales them by 0. Or the loss reaches the weights only through an operation whose "
                        "derivative is 0 (round, floor, sign, argmax, a hard threshold): train on what goes into it.")
        return [Finding("not_learning", "critical", why + ".", _steps_list(steps(run)[1:2]), hint=hint)]
    still, why = _weights_barely_move(run)
    t = _loss_trend(run)
    if not still or t is None or not _flat(t):
        return []
    untrained, _ = _chance_losses(run)
    if untrained and t.last < 0.5 * untrained:
        return []   # it learned before the first collection: still weights at the end of an annealed run
    first = _finite(column(run, "loss"))[:1]
    if len(first) and t.last <= 0.1 * abs(float(first[0])):
        return []   # it fell tenfold from the first record and stays there: converged (as L-BFGS stops), not stuck
    if any(late >= 0.99 and first >= DEAD_SHARE for _, late, first, *_ in _unhealthy_units(run, "dead", DEAD_SHARE)):
        # A ReLU layer dead from the first collection on passes no gradient: the layers before it get none and
        # those after it see a constant, so the weights stand still whatever the optimizer and learning rate.
        # dead_units names that cause (and takes the holdout at chance under it); "raise the learning rate"
        # would not help.
        return []
    level = f", the level of a model that knows nothing is {_fmt(untrained)}" if untrained else ""
    stopped = _stopped_moving(run)
    if stopped is not None:
        fast, step, now = stopped
        return [Finding(
            "not_learning", "critical",
            f"the weights stopped moving: their update ratio was up to {_fmt(fast)} per optimizer step until step "
            f"{step}, and since then a median {_fmt(now)}; the train loss does not fall: {_trend_text(t)}{level}.",
            _steps_list([step, *t.where[1:]]),
            hint="Steps that large push units to where they pass no gradient (sigmoid or tanh at their limits, ReLUs "
                 "that never fire) and the weights behind them stop: lower the learning rate (3-10x) or clip the "
                 "gradients; a larger one would not help.")]
    return [Finding(
        "not_learning", "critical",
        f"the weights barely move ({why}) and the train loss does not fall: {_trend_text(t)}{level}.",
        _steps_list(t.where), hint=hint)]


# Weights that moved this many times STILL_PACE per step early on, and a thousandth of that since, stopped.
STOPPED_PACE = 100


def _stopped_moving(run: Run):
    """(the fastest update ratio per optimizer step, the last step it was over STOPPED_PACE x STILL_PACE, the
    median since) when the weights moved fast and then all but stopped at a learning rate that did not fall
    with them (one that collapsed stops them too: lr_collapsed's); else None."""
    pace = column(run, "update_ratio.overall")[1:] / _steps_covered(run)[1:]
    ok = np.isfinite(pace)
    fast = np.flatnonzero(ok & (pace >= STOPPED_PACE * STILL_PACE))
    if not len(fast):
        return None
    since = _finite(pace[fast[-1] + 1:])
    if len(since) < 3 or float(np.median(since)) >= STILL_PACE or float(np.median(since)) * 1000 > pace[fast].max():
        return None
    lr = column(run, "learning_rates.overall")[1:]
    before, after = _finite(lr[:fast[-1] + 1]), _finite(lr[fast[-1] + 1:])
    if len(before) and len(after) and float(np.median(after)) < 0.1 * float(before.max()):
        return None
    return float(pace[fast].max()), int(steps(run)[1:][fast[-1]]), float(np.median(since))


def check_loss_stalled(run: Run) -> list:
    """The weights move but the train loss stays at the level of a model that knows only the label shares,
    from the start: the learning rate is too low for the loss to move, or the labels carry no signal."""
    t = _loss_trend(run)
    untrained, prior = _chance_losses(run)
    if t is None or prior is None or not _flat(t) or _weights_barely_move(run)[0]:
        return []
    if not _at_chance_level(t, prior):
        return []   # flat but away from the chance level: it learned before the first collection, or blew up
    h = holdout_data(run)
    late = _late(h, h.loss) if h else None
    if late is not None and late[0] < prior - max(2 * _loss_se(h), 0.1 * prior):
        return []   # the holdout (the same examples every time) is well past chance: noisy batches, not a stall
    loss = _finite(column(run, "loss"))
    k = max(3, int(math.ceil(0.2 * len(loss))))
    lowest = float(np.median(np.lib.stride_tricks.sliding_window_view(loss, k), axis=1).min())
    if lowest < prior - max(3 * t.se, 0.1 * prior):
        return []   # it fell well below the chance level on the way and came back (a blow-up): not from the start
    return [Finding(
        "loss_stalled", "warning",
        f"the train loss stayed at the chance level from the start: {_trend_text(t)}, against {_fmt(prior)} for a "
        f"model that predicts {_prior_model(run)}, although the weights move.", _steps_list(t.where),
        hint="Check that the labels line up with the inputs and that the loss is computed on the model output; "
             "then raise the learning rate (try 3-10x) or check the gradients reach the early layers.")]


def _peak_loss(run: Run, level: float, train: bool = True):
    """(value, step, which, first step at or above `level`) of the highest train (unless `train` is False) or
    holdout loss, or None."""
    candidates = []
    h = holdout_data(run)
    series = ((("train", column(run, "loss"), steps(run)),) if train else ()) + (
        ("holdout", h.loss if h else np.array([]), h.steps if h else np.array([])),)
    for which, x, st in series:
        x = np.where(np.isfinite(x), x, -np.inf)
        if len(x) and np.isfinite(x).any():
            i = int(np.argmax(x))
            candidates.append((float(x[i]), int(st[i]), which, int(st[np.argmax(x >= level)])))
    return max(candidates) if candidates else None


TRAIN_SCALE = 3.0   # a train loss this many times the holdout's per-example loss is on another scale
WEIGHTED_SCALE = 1.5   # ... for the blow-up's level: a loss weighted per class starts this far above or more


def _paired_losses(run: Run, h: Holdout) -> np.ndarray:
    """[train loss, holdout loss, step] rows for the collections that have both, finite, in order: the two
    losses of the same weights."""
    train = dict(zip(steps(run).tolist(), column(run, "loss").tolist()))
    pairs = np.array([(train.get(s, math.nan), v, s) for s, v in zip(h.steps.tolist(), h.loss.tolist())])
    return pairs[np.isfinite(pairs).all(axis=1)] if len(pairs) else pairs.reshape(0, 3)


def _train_loss_on_another_scale(run: Run, untrained: float, scale: float = TRAIN_SCALE, first: int = 0) -> bool:
    """Whether the recorded train loss is on another scale than a per-example mean (a loss summed over the
    batch, reduction="sum"): over the first fifth of the run (or its `first` collections) it is typically
    (the median) `scale` times
    the holdout's own per-example loss at the same collections and as far above `untrained`, the level of a
    model that knows nothing, while that holdout loss stays below a blow-up's 1.5x `untrained`. A mean over a
    batch and a mean over the holdout of the same weights differ by their sampling noise, not threefold over
    a fifth of the run; a blow-up sends the holdout's loss up as well."""
    h = holdout_data(run)
    if not h or untrained is None:
        return False
    pairs = _paired_losses(run, h)
    if len(pairs) < 5:
        return False
    early = pairs[:first or max(3, int(math.ceil(0.2 * len(pairs))))]
    tr, ho = early[:, 0], early[:, 1]
    return bool(np.median(tr) >= scale * untrained and np.median(ho) < 1.5 * untrained
                and (ho > 0).all() and np.median(tr / ho) >= scale)


def _began_with_a_bad_batch(run: Run, onset: int) -> bool:
    """Whether a rise of the loss first seen at step `onset` began with a bad batch: a loss spike the batch made
    (_bad_batches) at that step, or at the collection before it (the holdout shows the spoilt weights at the
    collection after the batch)."""
    bad = _bad_batches(run, _spikes(run))
    st = steps(run)
    return any(b <= onset <= (st[st > b][0] if (st > b).any() else b) for b in bad)


def check_loss_diverging(run: Run) -> list:
    """The loss went up and stayed up: a learning rate too high for the model. A rise that began with one bad
    batch is the loss spike's finding: the batch, not the learning rate, spoilt the weights."""
    t = _loss_trend(run)
    if t is None:
        return []
    reasons, where = [], []
    loss, st = column(run, "loss"), steps(run)
    # where the rise began: the last step the loss was still at or below its level at the start
    low = np.flatnonzero(np.isfinite(loss) & (loss <= t.first + 3 * t.se))
    rise = int(st[low[-1] + 1]) if len(low) and low[-1] + 1 < len(st) else t.where[0]
    if t.last - t.first > max(3 * t.se, 0.5 * abs(t.first)) and not _began_with_a_bad_batch(run, rise) \
            and not _holdout_improved(run):
        # rose by half again, beyond the noise
        reasons.append(f"the train loss rose from median {_fmt(t.first)} over the first fifth of the run to "
                       f"{_fmt(t.last)} over the last ({_change_text(t.first, t.last)})")
        where.append(t.where[0])
    untrained, prior = _chance_losses(run)
    # A model that knows nothing scores `untrained` per example; 1.5x that is a model confidently wrong, which
    # only a blow-up makes of a fresh one (the healthy corpus runs never pass 1.11x), and still being at the
    # chance level at the end means it never recovered. Both compare per-example losses: a train loss on
    # another scale (summed over the batch) is left out, and the holdout's own loss says where the model ended.
    # Here a loss 1.5x the holdout's at the first collections is on another scale too: weighted by class
    # without a normalisation (BCEWithLogitsLoss's pos_weight, 19 for 5% positives, starts near twice log 2),
    # its level for an untrained model is its own, and 1.5x log K is no blow-up of it.
    per_example = untrained is not None and not _train_loss_on_another_scale(run, untrained, WEIGHTED_SCALE, 3)
    peak = _peak_loss(run, 1.5 * untrained, train=per_example) if untrained else None
    if per_example:
        end, end_what = t.last, "the train loss is still {} over the last fifth of the run"
        tolerance = 3 * t.se
    else:
        h = holdout_data(run)
        late = _late(h, h.loss) if h else None
        end = late[0] if late else -math.inf
        end_what = "the holdout loss is still {} over the last quarter of the run"
        tolerance = 2 * _loss_se(h) if h else 0.0
    # At the chance level: that of a model that knows only the label shares (a blow-up that leaves a model
    # predicting the common class ends there), within the noise but never more than a tenth below it: the
    # noise of a loss on a larger scale must not stretch "still at chance" down to a model that learned.
    level = prior if prior else untrained
    if peak and peak[0] >= 1.5 * untrained and end >= level - min(tolerance, 0.1 * level) \
            and not _began_with_a_bad_batch(run, peak[3]):
        reasons.append(f"the {peak[2]} loss reached {_fmt(peak[0])} at step {peak[1]}, {peak[0] / untrained:.3g}x the "
                       f"{_fmt(untrained)} of a model that knows nothing, and " + end_what.format(_fmt(end)))
        where.append(peak[3])
    if not reasons:
        return []
    severity, players = "warning", _text(run.meta.get("optimizer") or "")
    if "+" in players and where == [t.where[0]] and not 0 < 10 * t.first < t.last:
        # Several optimizers stepped together, with one loss given: a player's of an adversarial game, as
        # often as not, and a GAN's generator loss rises (its gradients with it) while its discriminator learns
        severity = "info"
        reasons.append(f"the hook was given several optimizers ({players}), and this loss may be one player's: a "
                       "GAN's generator loss rises as its discriminator learns, and is no divergence by itself")
    return [Finding(
        "loss_diverging", severity, "; ".join(reasons) + ".", _steps_list(sorted(where)),
        hint="Lower the learning rate (try 3-10x smaller) or add warmup; clip gradients (clip_grad_norm_); with "
             "ReLU networks a blow-up early on also kills units for good.")]


def _holdout_improved(run: Run) -> bool:
    """Whether the holdout got better over the run and ended near its best, from the medians of its first 3
    evaluations and of its last quarter: its loss fell by a tenth and beyond twice its standard error and ends
    within a tenth (and that error) of its lowest, or its accuracy rose by a tenth and 3 binomial sigmas of the
    difference and ends within 0.05 (and 3 sigmas) of its highest (both smoothed over 3 evaluations). Then a
    train loss that rose does not say the model got worse; what it measures is not the model's fit (a policy
    gradient's, whose optimum is 0 from below; a penalty that grows). A run that learned and then blew up
    ends far from its best."""
    h = holdout_data(run)
    if h is None or len(h.steps) < 5:
        return False
    for values, better in ((h.loss, -1), (h.accuracy, 1)):
        early, late, ok = _finite(values[:3]), _late(h, values), _finite(values)
        if not len(early) or late is None or len(ok) < 3:
            continue
        a, b = float(np.median(early)), late[0]
        if better < 0:
            best, se = float(_smooth3(ok).min()), 2 * _loss_se(h)
            if a > 0 and a - b > max(0.1 * a, se) and b - best <= max(0.1 * best, se):
                return True
        else:
            best = float(_smooth3(ok).max())
            if b - a > max(0.1, 3 * math.hypot(_sigma(a, h.n), _sigma(b, h.n))) \
                    and best - b <= max(0.05, 3 * _sigma(best, h.n)):
                return True
    return False


KENDALL_POINTS = 400   # at most this many values, evenly spaced, go into Kendall's tau (it compares all pairs)


def _kendall_tau(x: np.ndarray) -> float:
    """Kendall's rank correlation of a series with time: the share of pairs in rising order minus that in
    falling order (1 for a series that only rises). A long series is thinned to KENDALL_POINTS evenly
    spaced values first."""
    if len(x) > KENDALL_POINTS:
        x = x[np.linspace(0, len(x) - 1, KENDALL_POINTS).round().astype(int)]
    n = len(x)
    if n < 2:
        return 0.0
    i, j = np.triu_indices(n, 1)
    return float(np.sign(x[j] - x[i]).sum() / len(i))


def _kendall_sigma(n: int) -> float:
    """The standard deviation of Kendall's tau of n values in random order (no trend)."""
    return math.sqrt(2 * (2 * n + 5) / (9 * n * (n - 1))) if n >= 2 else math.inf


def check_loss_oscillating(run: Run) -> list:
    """The holdout loss (the same examples every time, so no sampling noise) jumps up and down by a large
    share of its starting level without getting lower: steps that overshoot."""
    h = holdout_data(run)
    if not h:
        return []
    ok = np.isfinite(h.loss)
    x, st = h.loss[ok], h.steps[ok]
    if len(x) < 10:
        return []
    half = x[len(x) // 2:]
    # The jumps around the half's own drift: a holdout loss that climbs steadily (a holdout from other data
    # than the train batches, getting worse as the model learns those) moves by as much at every collection,
    # but in one direction; steps that overshoot send it up and down.
    d = np.diff(half)
    swing = float(np.median(np.abs(d - np.median(d))))
    scale = max(float(x[0]), _chance_losses(run)[0] or 0.0)
    # A tenth of the starting loss between two collections, typically: the healthy corpus runs stay under
    # 3% (their holdout loss moves smoothly once the first steps are done).
    if not (scale > 0 and swing >= 0.1 * scale) or np.median(half[:3]) - np.median(half[-3:]) > swing:
        return []
    if _kendall_tau(half) >= max(0.5, 3 * _kendall_sigma(min(len(half), KENDALL_POINTS))) and \
            _train_improved(run, float(st[len(x) // 2]))[0]:
        # The holdout loss climbs steadily (most pairs of collections in time order, beyond what swings around a
        # level give) while the train loss keeps falling: a model memorising its train batches (overfitting, or
        # labels that carry no signal), whose holdout loss churns as it climbs; not steps that overshoot.
        return []
    return [Finding(
        "loss_oscillating", "warning",
        f"the holdout loss jumps by a median {_fmt(swing)} between collections over the second half of the run "
        f"({swing / scale:.0%} of the {_fmt(scale)} it started from) without getting lower (median "
        f"{_fmt(float(np.median(half[:3])))} then, {_fmt(float(np.median(half[-3:])))} at the end).",
        _steps_list([st[len(x) // 2], st[-1]]),
        hint="Lower the learning rate (try 3x smaller) or decay it; with SGD, lower the momentum or use a larger "
             "batch.")]


def _grad_series(run: Run):
    """(steps, norms, segment ids) of the collections with a positive overall gradient norm (the groups'
    norms combined where no overall was recorded); (None, None, None) without gradient norms."""
    g = column(run, "gradient_norm.overall")
    if not has_values(run, "gradient_norm.overall"):
        groups = _groups(run, "gradient_norm")
        if not groups:
            return None, None, None
        stack = np.vstack([column(run, ("gradient_norm", k)) for k in groups])
        with np.errstate(invalid="ignore"):
            g = np.sqrt(np.nansum(stack ** 2, axis=0))
        g[np.all(~np.isfinite(stack), axis=0)] = np.nan
    ok = np.isfinite(g) & (g > 0)
    return steps(run)[ok], g[ok], segment_ids(run)[ok]


@dataclass
class Trend:
    """The gradient norm over one segment, with the medians of its first and last fifths."""
    steps: np.ndarray
    norms: np.ndarray
    head: float
    tail: float
    segment: int
    where: str      # "" for a run without restarts, else which stretch of steps it is


def _gradient_trends(run: Run) -> list:
    """A Trend per segment with 6 or more usable collections."""
    st, g, seg = _grad_series(run)
    if g is None:
        return []
    pieces = _pieces(seg)
    return [Trend(st[i], g[i], _edge_median(g[i], "first"), _edge_median(g[i], "last"), int(seg[i[0]]),
                  "" if len(pieces) == 1 else f" (steps {int(st[i[0]])}-{int(st[i[-1]])})")
            for i in pieces if len(i) >= 6]


def _losses_at(run: Run, t: Trend) -> np.ndarray:
    """The train loss at the trend's steps (NaN where a record has none)."""
    here = segment_ids(run) == t.segment
    by_step = dict(zip(steps(run)[here].tolist(), column(run, "loss")[here].tolist()))
    return np.array([by_step.get(s, math.nan) for s in t.steps.tolist()], dtype=float)


def _learning_through(loss: np.ndarray) -> bool:
    """The train loss fell by a fifth or more over the stretch and is at its lowest in its last fifth: gradients
    that grew meanwhile grew with the learning (a model leaving a plateau where they were tiny, as a
    transformer's classifier does), not in a blow-up, which leaves the loss higher or stuck."""
    loss = _finite(loss)
    if len(loss) < 6:
        return False
    fifths = [float(np.median(part)) for part in np.array_split(loss, 5)]
    return fifths[-1] <= 0.8 * fifths[0] and fifths[-1] <= 1.1 * min(fifths)


def _grad_growth(t: Trend, loss: np.ndarray):
    growth = t.tail / t.head
    if growth < 10 or _learning_through(loss):
        return None
    k = max(3, int(math.ceil(0.2 * len(t.norms))))
    return (f"the gradient norm grew {growth:.0f}x, from median {_fmt(t.head)} in the first fifth of the run to "
            f"{_fmt(t.tail)} in the last{t.where}", [int(t.steps[-k])])


def _grad_jumps(t: Trend, loss: np.ndarray):
    g, st = t.norms, t.steps
    med, _ = _prev_window_stats(g, 20, 5, with_mad=False)
    # Gradient norms vary multiplicatively, and by a lot with small batches (a batch of 4 holding one hard
    # example late in training gives 30x the median): a jump must also stand out from the run's own
    # spread, 6 robust sigmas of the log-norm's successive differences, as loss spikes do.
    y = np.log(g)
    ymed, _ = _prev_window_stats(y, 20, 5, with_mad=False)
    _, dmad = _prev_window_stats(np.diff(y), 20, 5)
    sigma = np.concatenate([[np.nan], 1.4826 * dmad / math.sqrt(2)])
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = g / med
        z = (y - ymed) / sigma
    # Near convergence the norm can wobble 100x around ~0; only jumps that matter on the run's
    # starting scale count.
    spikes = np.where((ratio >= 20) & (z >= 6) & (g >= 0.1 * t.head))[0]
    # A jump the loss fell through (lower over it and the next two collections than over the five before) is
    # the model starting to learn, not a blow-up.
    spikes = [i for i in spikes if not np.nanmedian(loss[i:i + 3]) < np.nanmedian(loss[max(i - 5, 0):i])] \
        if np.isfinite(loss).all() else spikes
    # A jump to the level the norm then keeps (the median of the 20 collections after it, 5 at least, within 4x
    # of it: 5x and more above where it was) is the norm's new scale, not a spike: a model leaving a plateau,
    # whose pre-clip norms grow as it learns. A norm that keeps growing is _grad_growth's.
    spikes = [i for i in spikes if not (len(g) - i - 1 >= 5 and np.median(g[i + 1:i + 21]) >= g[i] / 4)]
    if not len(spikes):
        return None
    worst = spikes[np.argmax(ratio[spikes])]
    return (f"{len(spikes)} collection(s) jumped to >= 20x the running median, worst {_fmt(g[worst])} "
            f"({ratio[worst]:.0f}x) at step {int(st[worst])}", [int(st[i]) for i in spikes])


def _blown_up_loss(run: Run, st, g):
    """A blow-up before the first collection shows as a loss far above the chance level log(C)
    together with gradients far above the rest of the run."""
    h = holdout_data(run)
    if not (h and h.kind == "classification" and h.num_classes):
        return None
    chance_loss = math.log(h.num_classes)
    loss_all = column(run, "loss")
    g_all = column(run, "gradient_norm.overall")
    if not has_values(run, "gradient_norm.overall"):
        g_all = np.full(len(loss_all), np.nan)
        g_all[np.isin(steps(run), st)] = g
    with np.errstate(invalid="ignore"):
        blown = np.where((loss_all > 10 * chance_loss) & (g_all > 10 * float(np.median(g))))[0]
    if not len(blown):
        return None
    i = blown[np.argmax(loss_all[blown])]
    return (f"the train loss reached {_fmt(loss_all[i])} at step {int(steps(run)[i])}, over 10x the chance level "
            f"{chance_loss:.3f}, with gradient norm {_fmt(g_all[i])} ({g_all[i] / np.median(g):,.0f}x the run's "
            "median)", [int(steps(run)[j]) for j in blown])


def check_exploding_gradients(run: Run) -> list:
    st, g, _ = _grad_series(run)
    if g is None or len(g) < 6:
        return []
    # Where the trainer clips (run.json's clip_grad_norm: the records' norms are taken before it), a lone jump
    # moves the weights no further than any clipped step: a batch the model gets sharply wrong late in a run
    # does that, and only a norm that keeps growing, or a loss that blows up, is left to tell.
    clipped = run.meta.get("clip_grad_norm") if _has_type(run.meta.get("clip_grad_norm"), (int, float)) else None
    rules = (_grad_growth,) if clipped else (_grad_growth, _grad_jumps)
    found = [rule(t, _losses_at(run, t)) for t in _gradient_trends(run) for rule in rules]
    found = [f for f in found + [_blown_up_loss(run, st, g)] if f]
    if not found:
        return []
    return [Finding(
        "exploding_gradients", "warning", "; ".join(text for text, _ in found) + ".",
        _steps_list(sorted(s for _, where in found for s in where)),
        hint="Lower the learning rate, " + (f"add warmup (the trainer clips the gradients at {_fmt(clipped)} "
                                            "already), " if clipped else
                                            "add gradient clipping (clip_grad_norm_ to ~1.0), add warmup, ")
             + "and check for unnormalised inputs or a loss that can blow up.")]


def _loss_converged(loss: np.ndarray) -> bool:
    """Whether a train loss series ends (median of its last tenth) at a tenth of where it began or less: its
    gradients shrink because there is little left to learn."""
    loss = _finite(loss)
    return len(loss) >= 6 and abs(_edge_median(loss, "last")) <= 0.1 * abs(_edge_median(loss, "first"))


def _shrinking_gradient(run: Run, t: Trend):
    growth = t.tail / t.head
    if growth > 1e-3 or _loss_converged(column(run, "loss")[segment_ids(run) == t.segment]):
        return None
    return Finding(
        "vanishing_gradients", "warning",
        f"the gradient norm shrank {1 / growth:,.0f}x, from median {_fmt(t.head)} to {_fmt(t.tail)}, "
        f"while the loss did not converge{t.where}.",
        _steps_list([t.steps[0], t.steps[-1]]),
        hint="Check saturating activations, too-deep plain stacks (add residuals/normalisation), an "
             "initialisation that is too small, or a learning-rate schedule that decays to ~0.")


def _starved_layers(run: Run):
    layers = section_keys(run, "layer_stats", skip_overall=False)
    if len(layers) < 2:
        return None
    meds = {}
    for k in layers:
        v = _finite(column(run, ("layer_stats", k, "grad_norm"))[1:])
        v = v[v > 0]
        if len(v):
            meds[k] = float(np.median(v))
    top = max(meds.values(), default=0.0)
    tiny = sorted((k for k, v in meds.items() if v < 1e-5 * top), key=meds.get)
    if not tiny:
        return None
    return Finding(
        "vanishing_gradients", "warning",
        f"{len(tiny)} layer(s) get gradients below 1e-5 of the largest layer's ({_fmt(top)}): "
        + ", ".join(f"{k} ({_fmt(meds[k])})" for k in tiny[:5]) + ("..." if len(tiny) > 5 else "") + ".",
        _steps_list(steps(run)[1:2]), group=tiny[0],
        hint="Early layers starving: add residual connections or normalisation, check activations "
             "and initialisation, or give those layers a larger learning rate.")


def _profile_ratio(run: Run):
    """(steps, first/last ratio, first layers, last layers) from grad_profile: per collection, the gradient
    norm of the first quarter of the layers (at least one) over that of the last quarter, each quarter's
    norms combined; None with fewer than 3 layers (no depth for a gradient to vanish over)."""
    layers = section_keys(run, "grad_profile", skip_overall=False)
    if len(layers) < 3:
        return None
    q = max(1, len(layers) // 4)
    m = np.vstack([column(run, ("grad_profile", k)) for k in layers])
    with np.errstate(invalid="ignore", divide="ignore"):
        first = np.sqrt(np.nansum(m[:q] ** 2, axis=0))
        last = np.sqrt(np.nansum(m[-q:] ** 2, axis=0))
        ratio = np.where(np.isfinite(m[:q]).any(axis=0) & (last > 0), first / last, np.nan)
    ok = np.isfinite(ratio)
    return steps(run)[ok], ratio[ok], layers[:q], layers[-q:]


# Under SGD a layer learns in proportion to its gradient: at 1e-3 of the last layers' gradient, the first
# layers take 1000 steps for one of theirs. The healthy corpus runs stay above 2e-2 (an LM's embedding).
VANISHED_RATIO = 1e-3


def _cut_layers(run: Run):
    """(layers whose gradient was exactly 0 at every collection, other layers that had one, collections)
    from grad_profile, or None. Exactly 0 from the first collection to the last is no gradient shrinking
    with depth: nothing passes gradient back to those layers at all. A layer with no gradient is null there
    (detached, unused), not 0; a layer of units that never fire, or a frozen layer whose weights are all 0,
    gives exact zeros."""
    layers = section_keys(run, "grad_profile", skip_overall=False)
    if len(layers) < 2:
        return None
    m = np.vstack([column(run, ("grad_profile", k)) for k in layers])
    seen = np.isfinite(m).any(axis=0)
    if seen.sum() < 4:
        return None
    m = m[:, seen]
    zero = [i for i in range(len(layers)) if np.isfinite(m[i]).all() and not m[i].any()]
    if not zero:
        return None
    # other layers that get gradient at most collections: the loss reaches them, and not these
    reached = [i for i in range(len(layers)) if i not in zero and np.mean(np.nan_to_num(m[i]) > 0) >= 0.9]
    if not reached:
        return None
    return [layers[i] for i in zero], [layers[i] for i in reached], int(seen.sum())


def check_gradient_cut(run: Run) -> list:
    cut = _cut_layers(run)
    if cut is None:
        return []
    zero, reached, n = cut
    # units that never fire cut the path too, and dead_units names them: dead from the first collection, as
    # the gradient was 0 from it (the holdout may show a few firing where the batches fire none). Units that
    # die later are what weight decay leaves of the layers cut off.
    if any(first >= DEAD_SHARE for _, _, first, *_ in _unhealthy_units(run, "dead", DEAD_SHARE)):
        return []
    total, trainable = (_num(_get(run.meta, ["parameters", k])) for k in ("total", "trainable"))
    frozen = total - trainable if math.isfinite(total) and math.isfinite(trainable) else 0
    held = (f" The model holds {int(frozen):,} frozen parameter elements (requires_grad False), which these "
            "records do not cover." if frozen > 0 else "")
    return [Finding(
        "gradient_cut", "critical",
        f"no gradient reaches layers {', '.join(zero[:6])}{' and more' if len(zero) > 6 else ''}: their gradient "
        f"was exactly 0 at every one of the {n} collections, from the first, while other layers "
        f"({', '.join(reached[:4])}{' and more' if len(reached) > 4 else ''}) got one. That is no gradient fading "
        "with depth: something between them and the loss multiplies it by 0 - a frozen layer whose weights are "
        "all 0, a mask of zeros, a layer of units that never fire, or, for an output head of their own, a loss "
        "term weighted 0 or left out of the total." + held,
        _steps_list([int(steps(run)[0])]), group=zero[0],
        hint="Give the layer after them nonzero weights (a zero init trains only while the layer itself trains: "
             "requires_grad_(True)), or remove the zero mask or factor on the path from these layers to the loss; "
             "for a head of its own, check that its loss term is in the total with a weight above 0 (a key "
             "misspelt in a dict of loss weights gives 0).")]


def _starved_first_layers(run: Run):
    prof = _profile_ratio(run)
    if prof is None or len(prof[1]) < 4:
        return None
    st, ratio, head, tail = prof
    later = ratio[len(ratio) // 2:]   # the run's own history: persistent, not a moment of the first steps
    med = float(np.median(later))
    # in a run whose loss fell tenfold the first layers have little left to learn, or the rest of the model did it
    # for them (a LoRA adapter's low-rank tensors set against a full head, on a task its base already solved)
    if med > VANISHED_RATIO or _loss_converged(column(run, "loss")):
        return None
    onset = st[np.argmax(ratio <= VANISHED_RATIO)]
    share = f"{_fmt(med)} of the gradient norm of" if med > 0 else "no gradient at all, against"
    return Finding(
        "vanishing_gradients", "warning",
        f"the first layers ({', '.join(head)}) get {share} the last ones ({', '.join(tail)}): median over the "
        f"second half of the run ({_fmt(float(ratio[0]))} at the first collection); below {VANISHED_RATIO:g}, the "
        "first layers barely learn.", _steps_list([onset, st[-1]]),
        group=head[0],
        hint="Add residual connections or normalisation (BatchNorm/LayerNorm), use ReLU-family activations instead "
             "of sigmoid/tanh in deep stacks, use a variance-preserving init (Kaiming/Xavier), or give the early "
             "layers a larger learning rate.")


def check_vanishing_gradients(run: Run) -> list:
    # layers that got exactly no gradient from the first collection on are gradient_cut's
    layered = None if check_gradient_cut(run) else _starved_first_layers(run) or _starved_layers(run)
    found = [_shrinking_gradient(run, t) for t in _gradient_trends(run)] + [layered]
    return [f for f in found if f is not None]


def _previous_max(x: np.ndarray, window: int) -> np.ndarray:
    """max(x[i - window:i]) for each i (of what there is before i; NaN at 0)."""
    out = np.full(len(x), np.nan)
    head = min(window, len(x) - 1)
    if head > 0:
        out[1:head + 1] = np.maximum.accumulate(x[:head])
    if len(x) > window:
        out[window:] = np.lib.stride_tricks.sliding_window_view(x, window).max(axis=1)[:len(x) - window]
    return out


def _loss_spikes(x: np.ndarray, positive: bool, untrained: float | None = None):
    """(spike indices, recent median per point) of one uninterrupted stretch of batch losses; `untrained`, the
    loss of a model that knows nothing where the holdout tells it, is the run's scale where its first losses
    (small batches that fell fast) are below it."""
    # Batch losses vary multiplicatively (late in training one hard example moves a batch's loss 10x),
    # so judge jumps on a log scale when the loss is positive, against the previous 50 batches.
    y = np.log(x) if positive else x
    med, _ = _prev_window_stats(y, 50, 10, with_mad=False)
    # The noise scale comes from batch-to-batch differences, so a falling loss (a trend) does not pass
    # for noise and hide a spike: MAD of successive differences / sqrt(2).
    _, dmad = _prev_window_stats(np.diff(y), 50, 9)
    noise = np.concatenate([[np.nan], 1.4826 * dmad / math.sqrt(2)])
    sigma = np.maximum(noise, 0.01 if positive else 1e-3 * np.abs(med))
    recent = np.exp(med) if positive else med
    scale = max(abs(float(np.median(x[:10]))), untrained or 0.0)
    # Batches of one or a few have losses with a heavy tail (their noise on the log scale is wide): a loss 10x
    # the worst of the previous 50 is a spike whatever that noise says.
    worst = _previous_max(x, 50)
    worst[:10] = np.nan
    with np.errstate(invalid="ignore"):
        # far outside the recent noise (or past anything recent), at least double the recent level, and
        # visible on the run's scale
        far = ((y - med) > (6 if positive else 8) * sigma) | (positive & (x > 10 * worst))
        spike = far & (x > 2 * np.abs(recent)) & (x - recent > 0.05 * scale)
    return np.where(spike)[0], recent


@dataclass
class Spikes:
    """The run's finite train losses and the loss spikes among them."""
    rows: np.ndarray      # the records the losses come from
    loss: np.ndarray
    steps: np.ndarray
    index: np.ndarray     # the spikes, as indices into loss
    events: list          # the first spike of each run of consecutive ones
    recent: np.ndarray    # the median of the previous batches, per loss
    positive: bool


def _spikes(run: Run) -> Spikes:
    loss = column(run, "loss")
    rows = np.flatnonzero(np.isfinite(loss))
    x, st, seg = loss[rows], steps(run)[rows], segment_ids(run)[rows]
    # A loss that is never negative is judged on the log scale even where some batches scored exactly 0 (a
    # float32 cross-entropy of an example the model is sure of, in batches of one): those count as the least
    # loss seen. On the linear scale the usual heavy tail of small batches' losses (one wrong example among
    # right ones) passes for spikes.
    positive = bool(np.all(x >= 0) and np.any(x > 0))
    judged = np.maximum(x, np.min(x[x > 0])) if positive else x
    idx, recent = [], np.full(len(x), np.nan)
    untrained, _ = _chance_losses(run)
    for part in _pieces(seg):   # the window starts again after each restart
        if len(part) >= 12:
            found, recent[part] = _loss_spikes(judged[part], positive, untrained)
            idx += list(part[found])
    idx = np.array(idx, dtype=int)
    events = [idx[0]] + [b for a, b in zip(idx[:-1], idx[1:]) if b > a + 1] if len(idx) else []
    return Spikes(rows, x, st, idx, events, recent, positive)


# A batch scoring 3x what the weights it met scored on the holdout, where the two usually agree, is not a
# sample of the same data; nor is one whose inputs are 10x off every other batch's in scale.
BATCH_MADE = 3.0
INPUT_SCALE = 10.0


def _bad_batches(run: Run, sp: Spikes) -> dict:
    """{step: why} for the loss spikes that the batch made and not the weights: the same weights had just scored
    the holdout (at the collection one step earlier) far below that batch, or the batch's inputs are of
    another scale than the run's (their fingerprint's sum of squares per example). A learning rate too high
    spoils the weights first: the holdout they score rises with the train loss, and the inputs stay as
    they were."""
    if not len(sp.events):
        return {}
    st, seg = steps(run), segment_ids(run)
    held = column(run, "holdout_logits.loss")
    size = column(run, "batch_stats.batch_size")
    with np.errstate(invalid="ignore", divide="ignore"):
        scale = np.array([_num(fp[1]) if isinstance(fp := _get(r, ["batch_stats", "fingerprint"]), list)
                          and len(fp) == 2 else math.nan for r in run.records]) / size
        ok = np.isfinite(scale) & (scale > 0)
        typical_scale = float(np.median(scale[ok])) if ok.sum() >= 10 else math.nan
        # the train loss of each step against the holdout loss of the step before, where both were collected
        prev = np.concatenate([[False], (np.diff(st) == 1) & (seg[1:] == seg[:-1])])
        ratio = np.full(len(st), np.nan)
        ratio[1:] = column(run, "loss")[1:] / held[:-1]
        ratio[~(prev & (np.concatenate([[0.0], held[:-1]]) > 0))] = np.nan
    usual = _finite(ratio)
    usual = float(np.median(usual[usual > 0])) if (usual > 0).sum() >= 10 else math.nan
    out = {}
    for e in sp.events:
        i = int(sp.rows[e])
        if sp.positive and ratio[i] >= BATCH_MADE * usual:
            out[int(st[i])] = (f"it scored {_fmt(sp.loss[e])} where the same weights had just scored "
                               f"{_fmt(held[i - 1])} on the holdout (step {int(st[i - 1])})")
        elif ok[i] and typical_scale > 0 and abs(math.log(scale[i] / typical_scale)) >= math.log(INPUT_SCALE):
            out[int(st[i])] = (f"its inputs' sum of squares is {_fmt(scale[i] / typical_scale)}x the median "
                               "batch's, per example")
    return out


def check_loss_spikes(run: Run) -> list:
    sp = _spikes(run)
    if not len(sp.index):
        return []
    x, st, idx, recent = sp.loss, sp.steps, sp.index, sp.recent
    worst = idx[np.argmax(x[idx] / np.maximum(np.abs(recent[idx]), 1e-12))]
    band = ('6 robust sigmas of log-loss above the median of the previous 50 batches or 10x the worst of them'
            if sp.positive else '8 robust sigmas above the median of the previous 50 batches')
    msg = (f"{len(sp.events)} loss spike(s) (more than {band}, and over twice that median); worst at step "
           f"{int(st[worst])}: {_fmt(x[worst])} vs recent median {_fmt(recent[worst])}")
    bad = _bad_batches(run, sp)
    if bad:
        b, why = next(iter(bad.items()))
        msg += f". The batch of step {b} was bad, not the weights: {why}"
        t = _loss_trend(run)
        before = _finite(x[st < b])[-5:]
        level = float(np.median(before)) if len(before) >= 3 else math.nan
        # the damage a bad batch did to the weights, where the loss never came back from it
        if t is not None and t.last > level + max(3 * t.se, 0.5 * abs(level)):
            msg += (f"; the train loss did not come back: {_fmt(t.last)} over the last fifth of the run, against "
                    f"{_fmt(level)} just before it")
    return [Finding(
        "loss_spike", "warning", msg + ".", _steps_list(st[sp.events]),
        hint="Look at the batches at those steps (bad/outlier data, wrong labels); lower the learning rate or "
             "clip gradients if spikes come with gradient jumps.")]


def _sigma(p: float, n: int) -> float:
    return math.sqrt(max(p * (1 - p), 1e-6) / max(n, 1))


def _late(h: Holdout, values: np.ndarray):
    """(median over the last quarter of the run's evaluations (at least the last two), that window's first
    step, the last step) of one holdout series; None with fewer than 5 evaluations."""
    st = h.steps
    if np.isfinite(values).sum() < 5:
        return None
    late = st >= st[0] + 0.75 * (st[-1] - st[0])
    late[-2:] = True
    x = _finite(values[late])   # a window of NaN (a run that blew up) says nothing about the level
    return (float(np.median(x)), int(st[late][0]), int(st[-1])) if len(x) else None


def _loss_se(h: Holdout) -> float:
    """Standard error of the mean holdout loss, from the spread of the last evaluation's per-example losses."""
    losses = _example_losses(h.raw[-1]) if h.raw else None
    losses = _finite(losses) if losses is not None else np.array([])
    return float(np.std(losses, ddof=1) / math.sqrt(len(losses))) if len(losses) >= 5 else 0.0


def _label_shares(h: Holdout) -> np.ndarray:
    if h.labels is None or not len(h.labels):
        return np.full(h.num_classes, 1.0 / h.num_classes)
    counts = np.unique(h.labels, return_counts=True)[1]
    return counts / counts.sum()


RARE_TOLD = 5   # holdout examples outside the most common class that can show a model does better than it


def _classification_at_chance(h: Holdout):
    """What says the holdout is no better than a model that knows nothing: its accuracy within the chance
    band or below it (one-sided: doing worse than chance is no better), its loss at the entropy of its labels
    while its accuracy is no better than the most common class's share, or one class predicted for all."""
    late = _late(h, h.accuracy)
    if late is None:
        return None
    acc, a, b = late
    n, k = int(h.n or 0) or 50, h.num_classes
    chance, band = 1.0 / k, 2 * _sigma(1.0 / k, n)
    shares = _label_shares(h)
    prior, majority = float(-(shares * np.log(shares)).sum()), float(shares.max())
    loss = _late(h, h.loss)
    # Against the most common class only where the holdout holds RARE_TOLD examples of the others: with fewer,
    # a model that knows them all scores within that class's noise band, and one trained with class weights
    # (whose loss on uneven labels is above their entropy, by design) scores below its share.
    by_loss = loss is not None and loss[0] >= prior - 2 * _loss_se(h) and acc <= majority + 2 * _sigma(majority, n) \
        and not _recalls_above_chance(h) and (1 - majority) * n >= RARE_TOLD
    single = [p for p in h.predictions_last if isinstance(p, list) and p]
    one_class = len(single) >= 2 and all(len(set(p)) == 1 for p in single) and len({p[0] for p in single}) == 1
    where = f"over the last quarter of the run (steps {a}-{b})"
    if one_class:
        why = (f"the model predicts class {single[-1][0]} for every holdout example in the last collections "
               f"(accuracy {acc:.3f} is just that class's share)")
    elif acc < chance - band:
        why = (f"holdout accuracy is {acc:.3f} {where}, below chance {chance:.3f} by more than 2 binomial sigmas "
               f"({band:.3f} for {n} examples, {k} classes): the model consistently predicts wrong classes")
    elif acc <= chance + band:
        why = (f"holdout accuracy is {acc:.3f} {where}, within the noise band of chance {chance:.3f} +/- {band:.3f} "
               f"(2 binomial sigmas for {n} examples, {k} classes)")
    elif by_loss:
        why = (f"holdout accuracy is {acc:.3f} {where}, no better than always predicting the most common class "
               f"({majority:.3f})")
    else:
        return None
    if loss is not None:
        why += (f"; the holdout loss is {_fmt(loss[0])}, against {_fmt(prior)} for a model that predicts only the "
                "label shares")
    return why, [a, b], acc < chance - band and not one_class


def _late_right(h: Holdout):
    """Per holdout example, the share of the last quarter of the evaluations (at least the last three) that
    got it right; None where the records hold no per-example result matching the labels."""
    if h.correct is None or h.labels is None or h.correct.shape[0] != len(h.labels) or not h.correct.shape[1]:
        return None
    return h.correct[:, -max(3, h.correct.shape[1] // 4):].astype(float).mean(axis=1)


def _recalls_above_chance(h: Holdout) -> bool:
    """Whether the holdout's balanced accuracy (the mean over its classes of the share of their examples
    recognised, over the last quarter of its evaluations) is over chance (1/classes) by 2 sigmas of chance's
    own spread. A model trained on rebalanced batches can score under the most common class's share on an
    uneven holdout while it recognises every class: always predicting that class scores 1/classes here."""
    right = _late_right(h)
    if right is None:
        return False
    k = int(h.num_classes)
    sizes = [int((h.labels == c).sum()) for c in range(k)]
    recalls = [float(right[h.labels == c].mean()) for c, size in zip(range(k), sizes) if size]
    if len(recalls) < 2:
        return False
    spread = math.sqrt(sum((1 / k) * (1 - 1 / k) / size for size in sizes if size)) / len(recalls)
    return float(np.mean(recalls)) > 1 / k + 2 * spread


CHANCE_R2 = 0.1   # the most of the mean's error (as R^2) a regression at chance may explain, whatever the noise


def _last_columns(h: Holdout, key: str) -> np.ndarray:
    """A regression holdout's last `key` ("targets", "predictions") as [examples, outputs] (one column for a
    single output, whose records hold a flat list), or an empty [0, 1] where the records hold none or a
    ragged one."""
    values = h.raw[-1].get(key) if h.raw else None
    if not isinstance(values, list) or not values:
        return np.zeros((0, 1))
    rows = [v if isinstance(v, list) else [v] for v in values]
    if len({len(r) for r in rows}) != 1:
        return np.zeros((0, 1))
    return np.array([[_num(v) for v in r] for r in rows], dtype=float).reshape(len(rows), -1)


def _last_targets(h: Holdout) -> np.ndarray:
    """The targets of a regression holdout's last evaluation, [examples, outputs], the examples with a
    non-finite one left out (empty where it has none)."""
    targets = _last_columns(h, "targets")
    return targets[np.isfinite(targets).all(axis=1)]


def _mean_variance(targets: np.ndarray) -> float:
    """The mean squared error of predicting each output's mean: the mean over outputs of their variances (the
    holdout's loss averages the squared errors over an example's outputs too)."""
    return float(np.var(targets, axis=0).mean())


def _log_link_outputs(h: Holdout) -> bool:
    """Whether a regression holdout's last outputs are the log of what its targets measure: every target is 0 or
    more, and the outputs' exponentials fit them, with a squared error under LOG_LINK_FIT of the targets'
    variance (what predicting their mean scores). A count model's log rates scored against the counts."""
    targets, outputs = _last_targets(h), _last_columns(h, "predictions")
    if len(targets) < 5 or targets.shape != outputs.shape or not (targets >= 0).all() \
            or not np.isfinite(outputs).all():
        return False
    rates = np.exp(np.clip(outputs, -50, 50))
    return float(np.mean((rates - targets) ** 2)) < LOG_LINK_FIT * _mean_variance(targets)


# a log link's exponentials fit the targets: their squared error under this share of the targets' variance
LOG_LINK_FIT = 0.8


def _regression_at_chance(h: Holdout):
    """The holdout's mean squared error no better than always predicting the targets' mean: R^2 <= 0 within
    the noise of the per-example errors (2 standard errors), and the point estimate itself near 0 (R^2 at most
    CHANCE_R2), as the classification version wants the accuracy inside a band around chance. A small holdout
    with heavy-tailed errors cannot show a fit's R^2 of 0.3 above 0 at 2 standard errors; that is a lack of
    evidence, not a model no better than the mean."""
    late = _late(h, h.loss)
    targets = _last_targets(h)
    if late is None or len(targets) < 5:
        return None
    mse, a, b = late
    var = _mean_variance(targets)
    if not var > 0 or mse < var - min(2 * _loss_se(h), CHANCE_R2 * var):
        return None
    return (f"the holdout mean squared error is {_fmt(mse)} over the last quarter of the run (steps {a}-{b}), no "
            f"better than the {_fmt(var)} of always predicting the targets' mean (R^2 {1 - mse / var:.2f})"), [a, b], False


# A language model's first holdout loss this far above its tokens' entropy: it had them to learn
FREQUENCIES_LEFT = 1.1


def _language_model_at_chance(run: Run, h: Holdout):
    """A language model's holdout loss over the last quarter of the evaluations no lower than the entropy of the
    holdout's own token frequencies (run.json's token_entropy, which telemetry measures at set_holdout_data):
    the least that any model ignoring the context can score on those tokens. Only after a first loss
    FREQUENCIES_LEFT times that level or more, and with the train loss no longer falling: on its way down every
    language model passes the level of the frequencies."""
    entropy, tokens = (_get(run.meta, ["holdout", key]) for key in ("token_entropy", "scored_tokens"))
    late, losses = _late(h, h.loss), _finite(h.loss)
    if late is None or not _has_type(entropy, (int, float)) or not _has_type(tokens, int) or tokens < 200 \
            or not entropy > 0 or losses[0] < FREQUENCIES_LEFT * entropy:
        return None
    loss, a, b = late
    # a holdout that ends worse than it began is on no model's way down, whatever its train loss still does
    if loss < entropy or _train_improved(run, a)[0] and loss <= losses[0]:
        return None
    # Whether it got as far as the frequencies: a model whose loss stayed near its first learned nothing at all
    learned = "the model learned which tokens are common and nothing from the context before them" \
        if loss < 0.5 * (losses[0] + entropy) else "the model learned nothing, not even which tokens are common" \
        if loss <= losses[0] else "it ends worse than it began: the model learned what these labels do not follow"
    return (f"the holdout loss is {_fmt(loss)} nats a token over the last quarter of the run (steps {a}-{b}), no "
            f"lower than the {_fmt(entropy)} of predicting each of its {tokens} scored tokens by how often it occurs "
            f"there: from a first loss of {_fmt(float(losses[0]))}, {learned}"), [a, b], False


def check_holdout_at_chance(run: Run) -> list:
    h = holdout_data(run)
    if not h:
        return []
    if h.kind == "lm":
        found = _language_model_at_chance(run, h)
        if found is None:
            return []
        hint = ("The context does not reach the model, or tells it nothing: check the tensor it is called on (the "
                "input_ids, not the attention mask or the labels), an attention mask that hides every position, and "
                "that the training text keeps its order (shuffle windows or documents, not tokens). A learning rate "
                "far too high also keeps a model there (its steps undo what the context taught): try a tenth. A run "
                "stopped early can sit at this level before it learns the context: train longer to be sure.")
        entropy, train = _get(run.meta, ["holdout", "token_entropy"]), _edge_median(column(run, "loss"), "last")
        if h.raw and h.raw[-1].get("shifted") is False and _has_type(entropy, (int, float)) and train < 0.5 * entropy:
            # a model that fits its train labels far better than the holdout's frequencies learned another mapping
            hint = (f"The train loss fell to {_fmt(train)} while the holdout's did not: the model learned labels "
                    "that fresh ones do not follow. Labels scored at their own positions (a tagger's tags, a "
                    "decoder's targets, next tokens shifted already) that are a position off in training (shifted "
                    "once too often, or not at all) or taken from another example teach such a mapping: check that "
                    "the training labels line up with their tokens as the holdout's do.")
        return [Finding("holdout_at_chance", "critical", found[0] + ".", _steps_list(found[1]), hint=hint)]
    if not (h.kind == "regression" or h.kind == "classification" and h.num_classes):
        return []
    found = _regression_at_chance(h) if h.kind == "regression" else _classification_at_chance(h)
    if found is None:
        return []
    if h.kind == "regression" and _log_link_outputs(h):
        _notice(run, "the regression holdout's outputs are the log of its targets' scale: as they are, they score "
                     "no better than the targets' mean, and their exponentials fit the targets (which are all 0 or "
                     "more). A log link, as a model trained with PoissonNLLLoss(log_input=True) has, is not at "
                     "chance: pass set_holdout_data(..., output=lambda out: out.exp()) to score the rates")
        return []
    why, where, below = found
    key = train_accuracy_key(run)
    tacc = _edge_median(column(run, key), "last") if key else math.nan
    extra = f"; train accuracy meanwhile is {tacc:.3f}" if math.isfinite(tacc) else ""
    hint = ("Below chance means a systematic mapping to wrong classes: check that the labels line up with the "
            "inputs (an off-by-one class index, a label array shuffled or sorted apart from the inputs, a class "
            "map that differs between train and holdout), and the loss's sign (a loss maximised, not minimised, "
            "teaches the model to avoid the right class)." if below else
            "If train accuracy is high this is memorisation: more data, augmentation, regularisation. If both are "
            "at chance: check labels line up with inputs, the learning rate, and that the holdout comes from the "
            "same distribution.")
    still = _holdout_standing_still(run, h)
    if still is not None:
        why += (f"; its loss stayed at {_fmt(still[0])} (within {HOLDOUT_STILL:.0%}) at all {still[1]} evaluations, "
                f"while the train loss went from {_fmt(still[2])} to {_fmt(still[3])} and the weights moved")
        hint = ("The holdout is not scored with the weights that train: a forward= that calls another model (an EMA "
                "or averaged copy never updated, a model loaded once, the copy made before training), or "
                "set_holdout_data given that copy's outputs. Score it with the model passed to on_batch_end, or "
                "update the copy.")
    gradless = _layers_without_gradient(run) if still is None else None
    if gradless is not None:
        below = False   # the layers that make its output never trained: nothing was learned, rightly or wrongly
        names = ", ".join(gradless[0][:4]) + (" and more" if len(gradless[0]) > 4 else "")
        why += (f"; {'layers' if len(gradless[0]) > 1 else 'layer'} {names} got no gradient at any of the "
                f"{gradless[2]} collections: the loss never reaches them")
        hint = ("A loss computed from another output than the one the holdout scores leaves the layers that make "
                "this one untrained: where those layers make it, compute the loss on the same output (the logits, "
                "not the features, of a (features, logits) tuple; the head the holdout reads, not an auxiliary "
                "one), or pass output= naming what the loss reads. Else check that the labels line up with the "
                "inputs.")
    spread = _prediction_spread(h) if h.kind == "regression" else None
    if still is None and spread is not None and spread[0] < FLAT_PREDICTIONS * spread[1] and abs(spread[2]) < FLAT_MEAN * spread[1]:
        why += (f"; its predictions barely vary (standard deviation {_fmt(spread[0])} against the targets' "
                f"{_fmt(spread[1])}) and sit at the targets' mean: about that one value for every example")
        outputs = _num(h.raw[-1].get("outputs", 1)) if h.raw else 1
        hint = ("One value for everything is what a squared error minimises when each output is compared with every "
                "target: an [N, 1] output against [N] targets in mse_loss broadcasts to [N, N] (PyTorch warns of "
                "a target size different to the input size), so compare output[:, 0] or targets of shape [N, 1]. "
                "Else check that the targets line up with the inputs." if outputs == 1 else
                "The targets' mean for every example is what a model learns from targets that say nothing about "
                "the inputs: check that the targets line up with the inputs (an array shuffled or sorted apart "
                "from them, the wrong column or file).")
    if still is None and h.kind == "regression" and _get(run.meta, ["holdout", "targets_are_inputs"]) is True:
        hint = ("The targets are the inputs: an autoencoder that reconstructs every input no better than their "
                "mean passes nothing through its code. In a VAE, the KL term outweighs the reconstruction and the "
                "posterior collapses to the prior (a reconstruction averaged over its elements against a KL "
                "summed over the latent dimensions; a KL weight too high): sum both over their elements, or weigh "
                "the KL down or anneal it. Else check that nothing cuts the code (a detached or zeroed "
                "bottleneck), and that the training targets line up with the inputs as the holdout's do (not "
                "an array shuffled apart from them).")
    # Below chance is learned, not a failure to learn: what the model was taught (a loss maximised, labels apart
    # from their inputs) comes before what its loss and gradients did while it learned it.
    code = "holdout_below_chance" if below and still is None else "holdout_at_chance"
    return [Finding(code, "critical", why + extra + ".", _steps_list(where), hint=hint)]


# A holdout loss that stays within this share of itself at every evaluation while the train loss changes by
# STILL_TRAIN and the weights move is not the training model's: a model that learns or memorises moves it more.
HOLDOUT_STILL = 0.01
STILL_TRAIN = 0.2


def _holdout_standing_still(run: Run, h: Holdout):
    """(holdout loss, evaluations, train loss at the start, at the end) when the holdout's loss never moved
    while the training did; else None."""
    held, t = _finite(h.loss), _loss_trend(run)
    drift = _finite(column(run, "drift.overall"))
    if len(held) < 5 or t is None or not len(drift) or drift[-1] <= 0:
        return None
    level = float(np.median(held))
    if not (level > 0 and held.max() - held.min() <= HOLDOUT_STILL * level):
        return None
    if abs(t.last - t.first) < STILL_TRAIN * abs(t.first):
        return None
    return level, len(held), t.first, t.last


# A regression whose predictions spread less than this share of its targets', with their mean within FLAT_MEAN
# of the targets' standard deviation from the targets' mean, predicts about the targets' mean for all.
FLAT_PREDICTIONS = 0.1
FLAT_MEAN = 0.25


def _prediction_spread(h: Holdout):
    """(standard deviation of the predictions, of the targets, |mean prediction - mean target|) at the holdout's
    last evaluation, each per output and averaged over them; None when it has not both for 5 or more examples."""
    pred, targets = _last_columns(h, "predictions"), _last_columns(h, "targets")
    if pred.shape != targets.shape:
        return None
    ok = (np.isfinite(pred) & np.isfinite(targets)).all(axis=1)
    if ok.sum() < 5:
        return None
    pred, targets = pred[ok], targets[ok]   # per output, then averaged: the outputs' means differ
    return (float(np.std(pred, axis=0).mean()), float(np.std(targets, axis=0).mean()),
            float(np.abs(pred.mean(axis=0) - targets.mean(axis=0)).mean()))


def _train_improved(run: Run, since_step: float):
    """(improved?, description) of the train loss from since_step to the end (train accuracy where there
    is no loss)."""
    st = steps(run)
    after = st >= since_step
    loss = column(run, "loss")
    before = _finite(loss[st <= since_step])
    loss = _finite(loss[after])
    if len(loss) >= 4:
        a, b = _edge_median(loss, "first", 0.25, 2), _edge_median(loss, "last", 0.25, 2)
        # From where it stood up to since_step, if lower (as many values as the quarter after): a train loss
        # falling back from a spike after since_step is no training that went on.
        k = max(2, int(math.ceil(0.25 * len(loss))))
        a = min(a, float(np.median(before[-k:]))) if len(before) else a
        return a - b >= 0.1 * abs(a), f"train loss fell from {_fmt(a)} to {_fmt(b)}"
    key = train_accuracy_key(run)   # only where the loop passed no loss
    if key:
        acc = _finite(column(run, key)[after])
        if len(acc) >= 4:
            a, b = _edge_median(acc, "first", 0.25, 2), _edge_median(acc, "last", 0.25, 2)
            if b - a >= 0.03:
                return True, f"train accuracy rose from {a:.3f} to {b:.3f}"
    return False, ""


def _smooth3(x: np.ndarray) -> np.ndarray:
    if len(x) < 3:
        return x.copy()
    padded = np.concatenate([x[:1], x, x[-1:]])
    return np.median(np.lib.stride_tricks.sliding_window_view(padded, 3), axis=1)


def _example_losses(h: dict):
    """Per-example holdout loss of one evaluation (LM nll, regression squared error, or from the
    classification logits), or None."""
    for key in ("nll", "squared_error"):
        if isinstance(h.get(key), list):
            return np.array([_num(v) for v in h[key]])
    logits, labels = holdout_logits_of(h), h.get("labels")
    if not (isinstance(logits, list) and isinstance(labels, list) and logits and len(logits) == len(labels)):
        return None
    try:
        z = np.array(logits, dtype=float)
        y = np.array(labels, dtype=int)
        z = z - z.max(axis=1, keepdims=True)
        return -(z[np.arange(len(y)), y] - np.log(np.exp(z).sum(axis=1)))
    except (ValueError, IndexError, TypeError, OverflowError):
        return None


def _holdout_loss_rise(h: Holdout):
    """(reason, [steps]) when the holdout loss rose past its best, beyond the run's own wobble and by a
    margin that matters; None otherwise. The wobble is the robust spread of the changes over the second half
    of the run, from one collection to the next and over a twentieth of the run (collected at every step, a
    small holdout's loss wanders further than its successive changes show): the rise must clear 6 of those
    (as loss spikes do; the healthy corpus runs reach 3.4, the overfitting ones thousands, their holdout
    loss climbing smoothly). The
    margin is 20% of the best: the corpus calls a run healthy while its test loss stays within 1.2x of its
    best, and overfit from 1.3x."""
    found = _best_and_end(h.loss, h.steps, np.argmin)
    if found is None:
        return None
    best, end, where, x, evaluations = found
    late = x[len(x) // 2:]
    wobble = max(_noise_sd(late), _noise_sd(late, lag=max(1, len(x) // 20)))
    if end - best < max(6 * wobble, 0.2 * abs(best), 1e-12):
        return None
    # The wobble is the same examples' loss over time; whether other data would rise too depends on how many
    # examples carry the rise. One example turning confidently wrong (a loss of 1-20 against ~0 for the rest)
    # lifts the mean of a 30-example holdout past the margin alone, while the others stay where they were,
    # and says nothing about a fresh test set: without its largest contributor, the rest of the holdout must
    # still rise beyond the wobble.
    # A classifier whose holdout accuracy climbed well past what it was at the loss's best (3 binomial sigmas
    # and 5 points, the last three evaluations' median) learned since: its loss rose with its confidence on
    # the examples it gets wrong (noisy labels, by design), and stopping at that best would keep the worse model.
    # Nor is a best no lower than an untrained classifier's loss (log K) one the model had learned: stopping
    # there keeps an untrained model (a run at chance is holdout_at_chance's).
    if h.kind == "classification" and len(h.accuracy) > max(evaluations):
        then, now = float(h.accuracy[evaluations[0]]), float(np.median(_finite(h.accuracy)[-3:]))
        n = int(h.n or 0) or 50
        if now - then >= max(0.05, 3 * _sigma((then + now) / 2, n)) or h.num_classes and h.num_classes >= 2 \
                and best >= 0.95 * math.log(h.num_classes):
            return None
    per = [_example_losses(h.raw[i]) if i < len(h.raw) else None for i in evaluations]
    if all(p is not None for p in per) and len(per[0]) == len(per[1]) >= 5:
        rise = per[1] - per[0]
        if np.isfinite(rise).all() and (rise.sum() - rise.max()) / len(rise) < max(6 * wobble, 1e-12):
            return None
    return (f"holdout loss rose from its best {_fmt(best)} at step {where[0]} to {_fmt(end)} ({end / best:.2f}x; "
            f"its wobble is {_fmt(wobble)})" if best > 0 else
            f"holdout loss rose from its best {_fmt(best)} at step {where[0]} to {_fmt(end)}"), where


def _holdout_accuracy_fall(h: Holdout, n: int):
    """(reason, [steps]) when holdout accuracy fell from its best beyond 3 binomial sigmas (the best of many
    noisy evaluations sits above the truth, hence 3) and by 5 points."""
    found = _best_and_end(h.accuracy, h.steps, np.argmax)
    if found is None or found[0] - found[1] < max(0.05, 3 * _sigma((found[0] + found[1]) / 2, n)):
        return None
    best, end, where, _, evaluations = found
    counts = _lost_and_gained(h, *evaluations)
    if counts is not None:   # McNemar: the examples lost since the best against those gained
        lost, gained = counts
        if lost - gained < 3 * math.sqrt(max(lost + gained, 1)):
            return None
    return f"holdout accuracy fell from its best {best:.3f} at step {where[0]} to {end:.3f}", where


def _lost_and_gained(h: Holdout, a: int, b: int):
    """(examples right at evaluation a and wrong at b, the other way round), from the holdout's right/wrong
    matrix; None where it has no column for either."""
    if h.kind != "classification" or h.correct is None:
        return None
    columns = [np.flatnonzero(h.matrix_steps == h.steps[k]) for k in (a, b)]
    if any(len(c) != 1 for c in columns):
        return None
    right_a, right_b = (h.correct[:, c[0]].astype(bool) for c in columns)
    return int((right_a & ~right_b).sum()), int((~right_a & right_b).sum())


def _best_and_end(values, steps, pick):
    """(best, end, [step of the best, last step], the finite values, (index of the evaluation the best is,
    index of the one the end is)) of a holdout series: the best of its 3-point smoothing (`pick` is np.argmin
    or np.argmax) and the median of its last three, each a value one evaluation had. None with fewer than 5
    values, or when the best lies in the last fifth of the run: nothing has had time to fall from it."""
    ok = np.flatnonzero(np.isfinite(values))
    x, st = values[ok], steps[ok]
    if len(x) < 5:
        return None
    sm = _smooth3(x)
    b = int(pick(sm))
    if st[-1] - st[b] < 0.2 * max(st[-1] - st[0], 1):
        return None
    end = float(np.median(x[-3:]))
    lo = max(b - 1, 0)
    at_best = lo + int(np.flatnonzero(x[lo:b + 2] == sm[b])[0])   # a median of 3 is one of them (the ends padded)
    at_end = len(x) - 3 + int(np.flatnonzero(x[-3:] == end)[0])
    return float(sm[b]), end, [int(st[b]), int(st[-1])], x, (int(ok[at_best]), int(ok[at_end]))


def check_overfitting(run: Run) -> list:
    """The holdout got worse past its best while the train loss kept falling. Decided on the holdout loss
    and accuracy alone; train accuracy, where the loop passes it, only goes into the message."""
    h = holdout_data(run)
    if not h:
        return []
    n = int(h.n or 0) or 50
    reasons, where = [], []
    for found in (_holdout_loss_rise(h), _holdout_accuracy_fall(h, n)):
        if found:
            improved, how = _train_improved(run, found[1][0])
            if improved:
                reasons.append(f"{found[0]} while {how}")
                where += found[1]
    if not reasons:
        return []
    key = train_accuracy_key(run)
    tacc, hacc = (_edge_median(column(run, key), "last") if key else math.nan), _finite(h.accuracy)
    gap = f"; train accuracy {tacc:.3f} vs holdout {float(np.median(hacc[-3:])):.3f}" \
        if math.isfinite(tacc) and len(hacc) else ""
    return [Finding(
        "overfitting", "warning", "; ".join(reasons) + gap + ".", _steps_list(sorted(set(where))),
        hint="Stop near the holdout-best step (early stopping), add regularisation (weight decay, dropout, "
             "augmentation), use more data or a smaller model.")]


def _forgetting_stats(correct: np.ndarray, same: np.ndarray) -> dict:
    """Forgetting counts of an examples x collections right/wrong matrix; `same` marks the pairs of
    successive collections inside one segment (a change across a restart is no event)."""
    events = correct[:, :-1] & ~correct[:, 1:] & same
    return {"events": int(events.sum()), "examples": int(events.any(axis=1).sum()),
            "first_steps": np.where(events.any(axis=0))[0]}


def _net_forgotten(correct: np.ndarray):
    """(peak window's first column, examples right at the peak and wrong at the end, the other way round,
    peak accuracy): each example's majority verdict over the 3 collections where holdout accuracy was at its
    best against the same over the last 3 (a majority of 3 ignores one-off flips near the boundary)."""
    w, m = 3, correct.shape[1]
    if m < 2 * w + 2:
        return None
    roll = np.convolve(correct.mean(axis=0), np.ones(w) / w, mode="valid")
    p = int(np.argmax(roll[:m - 2 * w + 1]))   # a peak window that ends before the last one starts
    at_peak, at_end = correct[:, p:p + w].sum(axis=1) >= 2, correct[:, -w:].sum(axis=1) >= 2
    return p, int((at_peak & ~at_end).sum()), int((~at_peak & at_end).sum()), float(roll[p])


def check_forgetting(run: Run) -> list:
    """Examples the model had right at its best and lost by the end. Churn near the decision boundary
    (examples flipping both ways) is normal and no finding: info needs a net loss of 2 or more examples at
    a McNemar z >= 2 (lost against regained); a warning needs a run that had learned (peak accuracy 3
    binomial sigmas above chance), a net loss that churn does not explain (10% of the holdout, z >= 3), and
    an end below the best by more than the holdout accuracy's own swings between collections account for
    (3 standard deviations of the difference of two 3-collection means): a noisy run (small batches, a high
    learning rate) passes through many models, and those at its best have examples right by chance that the
    model at the end has wrong."""
    h = holdout_data(run)
    if not h or h.kind != "classification" or h.correct is None or h.correct.shape[1] < 4:
        return []
    correct = h.correct.astype(bool)
    n = correct.shape[0]
    f = _forgetting_stats(correct, h.matrix_segments[:-1] == h.matrix_segments[1:])
    if not f["events"]:
        return []
    st = h.matrix_steps
    msg = (f"{f['events']} forgetting event(s) (an example right at one collection and wrong at the next; "
           f"Toneva et al. 2019) across {f['examples']} of {n} holdout examples")
    net = _net_forgotten(correct)
    if not net:
        return []
    p, lost, regained, peak = net
    chance = 1.0 / (h.num_classes or 2)
    z = (lost - regained) / math.sqrt(lost + regained) if lost + regained else 0.0
    if lost - regained < 2 or z < 2:
        return []   # churn: as many examples regained as lost, within the noise
    accuracy = correct.mean(axis=0)
    end = float(accuracy[-3:].mean())
    swing = _noise_sd(accuracy[len(accuracy) // 2:])   # of one collection's accuracy, late in the run
    within = peak - end <= 3 * swing * math.sqrt(2 / 3)
    many = lost - regained >= max(3, 0.1 * n)   # more than churn explains
    large = peak >= chance + 3 * _sigma(chance, n) and many and z >= 3 and not within
    msg += (f"; {lost} examples right around the holdout's best (steps {int(st[p])}-{int(st[p + 2])}, "
            f"accuracy {peak:.3f}) are wrong at the end and {regained} the other way round")
    if large:
        hint = ("Learned examples were lost for good: lower the learning rate late in training, check for a "
                "data-distribution shift between epochs, or keep the holdout-best checkpoint.")
    elif within and many:
        hint = (f"The end ({end:.3f}) is below the best by less than the holdout accuracy's own swings explain (it "
                f"moves by about {swing:.3f} from one collection to the next late in the run): the best was a lucky "
                "model of a noisy run, not knowledge lost for good. Keep the holdout-best checkpoint, or lower the "
                "learning rate late for a steadier end.")
    else:
        hint = ("A few more examples lost than regained since the holdout's best: watch whether it grows, and "
                "keep the holdout-best checkpoint.")
    return [Finding("forgetting", "warning" if large else "info", msg + ".", _steps_list(st[f["first_steps"] + 1]),
                    hint=hint)]


def _batch_counts(run: Run):
    """(classes, counts matrix batches x classes, batch sizes, steps) from classification batch_stats."""
    names = section_keys(run, "batch_stats.counts", skip_overall=False)
    if names:
        m = np.vstack([column(run, ("batch_stats", "counts", c)) for c in names]).T
    else:   # older records: only "<label_key>_<value>_pct" and batch_size
        first = next((r["batch_stats"] for r in run.records if isinstance(r.get("batch_stats"), dict)), {})
        key = f"{first.get('label_key') or ''}_"
        pct_keys = [k for k in section_keys(run, "batch_stats", skip_overall=False)
                    if k.endswith("_pct") and k.startswith(key)]
        if not pct_keys:
            return None
        names = [k[len(key):-4] for k in pct_keys]
        size = column(run, "batch_stats.batch_size")
        m = np.vstack([column(run, ("batch_stats", k)) * size / 100.0 for k in pct_keys]).T
    rows = np.isfinite(m).any(axis=1)
    if not rows.any():
        return None
    m = np.nan_to_num(m[rows])   # a class missing from a batch's counts had 0 examples in it
    order = sorted(range(len(names)), key=lambda i: (len(names[i]), names[i]))
    return [str(names[i]) for i in order], m[:, order], m.sum(axis=1), steps(run)[rows]


def _int_or_none(text):
    """A label value ("3") as an int; None where it is not a whole number."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        return None
    return int(value) if math.isfinite(value) and value == int(value) else None


def _train_shares(run: Run):
    """(labels, share of each in the train batches, batches, steps) of a classification run, classes the
    holdout knows of but no batch held included at share 0; None without label counts or for regression."""
    bc = _batch_counts(run)
    h = holdout_data(run)
    if not bc or (h and h.kind == "regression") or bc[2].sum() <= 0:
        return None   # a regression's batch "labels" are targets, not classes
    names, m, sizes, st = bc
    unseen = []
    if h and h.kind == "classification" and h.num_classes and h.num_classes <= 32:
        unseen = [str(c) for c in range(h.num_classes) if str(c) not in names]
    shares = np.concatenate([m.sum(axis=0) / sizes.sum(), np.zeros(len(unseen))])
    return names + unseen, shares, len(sizes), st


def check_class_never_predicted(run: Run) -> list:
    """A class the train batches hold about as often as the others (half its even share or more) that the
    model never predicts on the holdout in its last three evaluations, whose examples of it (5 or more) are
    all wrong over the last quarter, each with that class's logit the lowest of all, while it recognises 8 in
    10 of the other classes' examples: the loss never asked for it. CrossEntropyLoss(ignore_index=0) copied
    from text code, where 0 pads, skips a real class 0;
    a class weight of 0 does the same."""
    h, found = holdout_data(run), _train_shares(run)
    right = _late_right(h) if h is not None and h.kind == "classification" and (h.num_classes or 0) >= 3 else None
    preds = [p for p in h.predictions_last if isinstance(p, list) and p] if right is not None else []
    if right is None or not preds or found is None:
        return []
    share, never = dict(zip(*found[:2])), []
    try:   # the last evaluation's logits, where the records keep them
        z, y = np.array(holdout_logits_of(h.raw[-1]), dtype=float), np.array(h.raw[-1].get("labels"), dtype=int)
    except (TypeError, ValueError):
        return []
    if z.ndim != 2 or z.shape != (len(y), h.num_classes) or len(y) != len(h.labels):
        return []
    for c in range(h.num_classes):
        mine = h.labels == c
        # its logit the lowest of all on every example of it: pushed down by the others' losses, never up
        # (a class the model is slow to learn ranks among the others on its own examples)
        if mine.sum() >= 5 and not right[mine].any() and share.get(str(c), 0) >= 0.5 / h.num_classes \
                and all(c not in p for p in preds) and right[~mine].mean() >= 0.8 \
                and (z[y == c, c] <= z[y == c].min(axis=1)).all():
            never.append((c, int(mine.sum()), share[str(c)]))
    if not never:
        return []
    said = "; ".join(f"class {c}: {n} holdout examples, {s:.0%} of the train batches' labels" for c, n, s in never)
    return [Finding(
        "class_never_predicted", "warning",
        f"the model never predicts {'classes' if len(never) > 1 else 'class'} "
        f"{', '.join(str(c) for c, *_ in never)} on the holdout, though the training batches hold "
        f"{'them' if len(never) > 1 else 'it'} as often as the others, while it gets the other classes' examples "
        f"right {float(np.mean([right[h.labels != c].mean() for c, *_ in never])):.0%} of the time ({said}).",
        _steps_list([int(h.steps[-1])]),
        hint="The loss never asks for that class: CrossEntropyLoss(ignore_index=...) set to a real class (the 0 "
             "that pads text, copied to labels where 0 is a class; the default, -100, is no class), a class weight "
             "of 0, or the class's labels masked or mapped to another before the loss.")]


def _rare_classes_neglected(h: Holdout, labels: list, shares: np.ndarray):
    """(True/False, text) whether the holdout's examples of the classes rarer than even in the train batches
    are recognised far less often than those of the other classes, over the last quarter of its evaluations
    (at least the last three); None where the holdout cannot tell (no per-example data, or fewer than 5
    examples on either side)."""
    right = _late_right(h) if h is not None and h.kind == "classification" else None
    if right is None:
        return None
    try:
        classes = [int(c) for c in labels]
    except ValueError:
        return None
    rare = [c for c, share in zip(classes, shares) if share < 1.0 / len(labels)]
    is_rare = np.isin(h.labels, rare)
    if is_rare.sum() < 5 or (~is_rare).sum() < 5:
        return None
    r_rare, r_common = float(right[is_rare].mean()), float(right[~is_rare].mean())
    # Three sigmas of the difference of two recalls (both sides are samples: a few hard examples among a
    # small holdout's rare ones lower its rare recall while fresh data's stays level), and 10 points: class
    # weights or a balanced sampler bring the rare classes' recall up to the others'.
    n_rare, n_common = int(is_rare.sum()), int((~is_rare).sum())
    pooled = float(right.mean())
    margin = max(0.1, 3 * math.sqrt(max(pooled * (1 - pooled), 1e-6) * (1 / n_rare + 1 / n_common)))
    return (r_common - r_rare > margin,
            f"the holdout's {int(is_rare.sum())} examples of the rarer classes are {r_rare:.0%} right, those of the "
            f"others {r_common:.0%}")


def _train_set_size(run: Run):
    """Examples in an epoch of train batches (the batch size times the optimizer steps per epoch, from the
    epoch numbers the loop passed), or None where the epoch never advances."""
    ep, st, size = column(run, "epoch"), steps(run), column(run, "batch_stats.batch_size")
    ok = np.isfinite(ep) & np.isfinite(size) & (size > 0)
    if ok.sum() < 2 or ep[ok][-1] - ep[ok][0] < 1 or st[ok][-1] <= st[ok][0]:
        return None
    return float(np.median(size[ok])) * (st[ok][-1] - st[ok][0]) / (ep[ok][-1] - ep[ok][0])


# A holdout that scores this many times the share of positions the training batches supervise measures mostly
# positions the training never teaches (a prompt masked in training and not in the holdout: a few times; one
# answer token per sequence against whole sequences: tens of times).
UNTRAINED_POSITIONS = 4.0


def check_holdout_positions_untrained(run: Run) -> list:
    """A language model's holdout scored on a far larger share of its positions (run.json's scored_tokens over
    label_positions) than the training batches supervise (their label_share, labels other than -100): most
    of what the holdout scores, the training never asks for. Either the training's labels hide what should
    train (a mask set to -100 beyond the answer), or the holdout lacks the training's mask."""
    h = holdout_data(run)
    held, positions, entropy = (_get(run.meta, ["holdout", k]) for k in ("scored_tokens", "label_positions",
                                                                          "token_entropy"))
    share = _finite(column(run, "batch_stats.label_share"))
    if not h or h.kind != "lm" or not _has_type(held, int) or not _has_type(positions, int) or positions <= 0 \
            or len(share) < 3:
        return []
    trained, scored = float(np.median(share)), held / positions
    if not (0 < trained and scored >= UNTRAINED_POSITIONS * trained):
        return []
    late = _late(h, h.loss)
    at_chance = late is not None and _has_type(entropy, (int, float)) and late[0] >= entropy
    level = (f" Its loss ended at {_fmt(late[0])} nats a token (steps {late[1]}-{late[2]}), no lower than the "
             f"{_fmt(entropy)} of the tokens' own frequencies: the model predicts those positions at chance."
             if at_chance else "")
    return [Finding(
        "holdout_positions_untrained", "critical" if at_chance else "warning",
        f"the training batches supervise {_fmt(100 * trained)}% of their label positions (a median over "
        f"{len(share)} batches; the others are -100), while the holdout is scored on {_fmt(100 * scored)}% of its "
        f"own ({held} tokens of {positions}): most of what it scores, the training never asks for." + level,
        _steps_list([int(steps(run)[0])]),
        hint="If every position should train, the labels hide most of them: set -100 only on what must not train "
             "(padding, the prompt), not beyond the answer. If only the answers should train (the prompt masked), "
             "give the holdout the same mask, so that it scores what the training teaches.")]


def check_padding_supervised(run: Run) -> list:
    """Padding positions (attention_mask 0) whose labels are not IGNORE_INDEX, in most of a language model's
    train batches: the loss trains the model to predict the pad token, and a holdout built the same way
    counts those easy positions too (its loss reads better than the text's)."""
    padded, supervised = column(run, "batch_stats.padding_share"), column(run, "batch_stats.padding_supervised")
    ok = np.isfinite(padded) & np.isfinite(supervised) & (padded > 0)
    if ok.sum() < 3:
        return []
    share = supervised[ok] / padded[ok]
    if np.median(share) < 0.5 or np.median(supervised[ok]) < 0.01:
        return []
    return [Finding(
        "padding_supervised", "warning",
        f"in {int((share > 0).sum())} of {int(ok.sum())} train batches the padding (attention_mask 0) has labels: "
        f"a median {float(np.median(share)):.0%} of the padding positions, "
        f"{_fmt(100 * float(np.median(supervised[ok])))}% of all positions, train the model to predict padding.",
        _steps_list(steps(run)[ok][share > 0][:1]),
        hint="Set the labels to -100 where attention_mask is 0 (DataCollatorForLanguageModeling does; with "
             "pad_token = eos_token, mask by the attention mask, not by the token id), in the holdout too.")]


# Standardised features and pixels in [0, 1] have a root mean square near 1 or below; raw pixels of 0-255 or
# tabular features in the hundreds are far above it. Inputs that large make the first layer's pre-activations
# and gradients as large: ReLUs die at the first steps, tanh saturates, updates blow up.
UNSCALED_RMS = 10.0
# A classifier starts near log K whatever it is, on inputs of a sane scale (over the first tenth of the run,
# the diagnosis corpus's runs stay within 2.1x it, a learning rate 40x too high included); several times that
# is logits blown up by the inputs.
UNSCALED_START = 5.0


def _input_moments(run: Run) -> list:
    """(step, mean, variance) per element of each batch's floating-point inputs, from their fingerprint (sum x,
    sum x^2) and element count, for the records that have them with two elements or more (integer inputs
    have none)."""
    out = []
    for r in run.records:
        fp, n = _get(r, ["batch_stats", "fingerprint"]), _get(r, ["batch_stats", "input_elements"])
        if isinstance(fp, list) and len(fp) == 2 and _has_type(n, int) and n > 1:
            mean, square = _num(fp[0]) / n, _num(fp[1]) / n
            if math.isfinite(mean) and math.isfinite(square):
                out.append((r.get("step"), mean, max(square - mean * mean, 0.0)))
    return out


def _input_rms(run: Run):
    """(median root mean square per element of the batches' floating-point inputs, batches) from their
    fingerprints; None with fewer than 3 such batches."""
    rms = [math.sqrt(mean * mean + var) for _, mean, var in _input_moments(run)]
    return (float(np.median(rms)), len(rms)) if len(rms) >= 3 else None


HOLDOUT_SHARE = 0.02   # this share of the looked-up training examples being holdout ones, and the holdout overlaps
HOLDOUT_EXCESS = 3.0   # ... and this many times the share that the holdout's own repeated inputs lead one to expect


def check_holdout_in_training(run: Run) -> list:
    """Training examples that are holdout examples: telemetry looks the first few examples of each collected
    batch up among the holdout's (batch_stats.holdout_matches of holdout_checked: equal sums of their inputs,
    plain and randomly weighted). HOLDOUT_SHARE of them or more, and at least 5: the holdout was drawn from the
    training data (or the training data holds it), so its accuracy and loss are those of examples the model
    trains on. A dataset's own duplicates, split apart at random, come to far less -- unless its inputs take
    few values (one-hot codes, a few categorical features). Then the holdout's inputs repeat among themselves
    too (run.json's input_pairs, pairs of holdout examples with the same inputs, which telemetry counts at
    set_holdout_data), and a training example drawn from the same data matches one of H holdout examples with
    probability 1 - (1 - c)^H, c the share of the holdout's pairs that are equal. The finding needs
    HOLDOUT_EXCESS times that share, or of the one the training rows looked up give by their own equal pairs
    (batch_stats.checked_pairs)."""
    found, checked = (_finite(column(run, f"batch_stats.{key}")) for key in ("holdout_matches", "holdout_checked"))
    if len(found) != len(checked) or not len(checked):
        return []
    matched, looked = int(found.sum()), int(checked.sum())
    examples, pairs = (_get(run.meta, ["holdout", key]) for key in ("examples", "input_pairs"))
    expected = 0.0
    if _has_type(examples, int) and _has_type(pairs, int) and examples > 1:
        expected = 1 - (1 - pairs / (examples * (examples - 1) / 2)) ** examples
    # The same from the training inputs looked up, which repeat among themselves as often: a 50-example holdout
    # of a 1,024-value input space holds no equal pair about a third of the time, thousands of batch rows do
    both = [(c, p) for c, p in zip(column(run, "batch_stats.holdout_checked"), column(run, "batch_stats.checked_pairs"))
            if math.isfinite(c) and math.isfinite(p)]
    possible = sum(c * (c - 1) / 2 for c, _ in both)
    if possible and _has_type(examples, int):
        expected = max(expected, 1 - (1 - sum(p for _, p in both) / possible) ** examples)
    if matched < 5 or matched < HOLDOUT_SHARE * looked or matched < HOLDOUT_EXCESS * expected * looked:
        return []
    return [Finding(
        "holdout_in_training", "warning",
        f"the holdout overlaps the training data: {matched} of the {looked} training examples looked up at the "
        f"{len(checked)} collections (the first {_fmt(float(np.median(checked)))} of each batch) have the inputs "
        f"of a holdout example ({matched / looked:.0%})"
        + (f", a holdout of {examples}" if _has_type(examples, int) else "") + ". Its accuracy and loss are "
        "measured on examples the model trains on: they overstate how it does on new ones, and overfitting "
        "cannot show on them.", _steps_list(steps(run)[:1]),
        hint="Split the holdout off before training and train only on the rest (one random_split or "
             "train_test_split of the indices); look for a holdout taken as train[:n], or a training set "
             "concatenated with its own test split.")]


HOLDOUT_OFF_SCALE = 4.0   # the holdout's inputs this many times larger or smaller than the training batches'


def check_holdout_off_scale(run: Run) -> list:
    """The holdout's inputs on another scale than the training batches': a holdout that skipped the training
    data's preprocessing (standardised train features against raw holdout ones, pixels divided by 255 in one
    and not the other). Root mean square per element: the holdout's from run.json (telemetry measures it at
    set_holdout_data), the training batches' the median over their fingerprints; HOLDOUT_OFF_SCALE times
    apart or more, over at least 3 batches, and the holdout at chance. Whatever it then says about the model
    is about the pipeline. A holdout the model reads well is left alone: the batch passed to on_batch_end
    may be the loader's, before a normalisation the loop applies itself."""
    held, found = _get(run.meta, ["holdout", "input_rms"]), _input_rms(run)
    if not _has_type(held, (int, float)) or not math.isfinite(held) or found is None:
        return []
    train, batches = found
    if not train > 0 or not held > 0:
        return []
    ratio = held / train
    if 1 / HOLDOUT_OFF_SCALE < ratio < HOLDOUT_OFF_SCALE or not check_holdout_at_chance(run):
        return []
    return [Finding(
        "holdout_off_scale", "warning",
        f"the holdout's inputs are on another scale than the training batches': root mean square per element "
        f"{_fmt(held)} against {_fmt(train)} ({_fmt(ratio)}x; the median over {batches} training batches). The "
        "holdout did not go through the training data's preprocessing (normalisation, scaling), so the model "
        "is scored on inputs it never saw the like of.", _steps_list(steps(run)[:1]),
        hint="Pass set_holdout_data inputs transformed exactly as the training batches are (the same "
             "normalisation, with the training set's statistics).")]


def check_constant_inputs(run: Run) -> list:
    """Every training batch's inputs hold one value (all zeros, from integer division of integer pixels,
    say): the model sees nothing that tells examples apart and can learn only the label shares. Read from
    the batch fingerprints (sum x and sum x^2 give each batch's variance; 0 to float32's precision), at 90%
    or more of the batches and at least 5, in a run whose train loss never fell or ends at the level of a
    model that knows only the label shares: a constant first tensor in a run that learns is not its inputs."""
    moments = _input_moments(run)
    constant = [(step, mean) for step, mean, var in moments if var <= 1e-6 * max(mean * mean, 1e-30)]
    t = _loss_trend(run)
    if len(constant) < max(5, 0.9 * len(moments)) or t is None:
        return []
    _, prior = _chance_losses(run)
    if not (_flat(t) or prior is not None and _at_chance_level(t, prior)):
        return []
    values = sorted({_fmt(mean) for _, mean in constant})
    return [Finding(
        "constant_inputs", "critical",
        f"the inputs hold one value in every batch: in {len(constant)} of the {len(moments)} batches collected "
        f"every element of the batch's inputs (its first tensor) is {' or '.join(values[:3])}"
        f"{', ...' if len(values) > 3 else ''} (variance 0, from the batch fingerprints), so the model cannot "
        f"tell the examples apart, and the train loss {_trend_text(t)}.", _steps_list([constant[0][0]]),
        hint="Check the input pipeline on one batch: integer division of integer pixels (x // 255 is 0 below 255), "
             "a normalisation with the wrong statistics, a transform that blanks the inputs, or the wrong tensor "
             "passed to the model.")]


def _troubles(run: Run, checks: tuple) -> list:
    """The codes of the findings these checks give the run, sorted."""
    return sorted({f.code for check in checks for f in check(run)})


BN_SMALL_BATCH = 4   # examples per batch at or under which BatchNorm's batch statistics are noise


STATS_AT_INIT_GAP = 2.0   # the holdout's loss this many times the train loss's over the run's end


def check_batchnorm_stats_at_init(run: Run) -> list:
    """BatchNorm layers built with momentum=0 whose running statistics were still at their initial 0 and 1
    (run.json's batchnorm_stats_at_init): momentum 0 never moves them, so evaluation (the holdout, inference)
    normalises with 0 and 1 while training normalises each batch with its own; the holdout's loss over the
    last quarter of the run is STATS_AT_INIT_GAP times the train loss's at the same weights or more."""
    names = [_text(n) for n in run.meta.get("batchnorm_stats_at_init") or [] if isinstance(n, str)] \
        if isinstance(run.meta.get("batchnorm_stats_at_init"), list) else []
    h = holdout_data(run)
    pairs = _paired_losses(run, h) if names and h else np.zeros((0, 3))
    if len(pairs) < 5:
        return []
    late = pairs[-max(2, len(pairs) // 4):]
    train, held = float(np.median(late[:, 0])), float(np.median(late[:, 1]))
    if not (train > 0 and held >= STATS_AT_INIT_GAP * train):
        return []
    return [Finding(
        "batchnorm_stats_at_init", "warning",
        f"BatchNorm layer(s) {', '.join(names[:4])}{' and more' if len(names) > 4 else ''} have momentum=0, and "
        "their running statistics were at their initial mean 0 and variance 1: momentum 0 never moves them, so "
        "evaluation normalises with those while training uses each batch's own. Over the run's last quarter "
        f"the holdout's loss, scored in eval mode, is {held / train:.1f}x the train loss ({_fmt(held)} against "
        f"{_fmt(train)}).", _steps_list([int(late[0, 2])]),
        hint="Leave BatchNorm's momentum at 0.1 (or None, a running average over every batch): momentum is the "
             "weight of the new batch's statistics, and 0 keeps the initial ones for good.")]


def check_batchnorm_small_batches(run: Run) -> list:
    """BatchNorm layers (run.json's batchnorm) trained on batches of BN_SMALL_BATCH examples or fewer (the
    median over the records), in a run that blows up, starves its first layers, stalls, or whose holdout ends
    at chance or overfits:
    normalised over two examples, every unit reads about +1 or -1 whatever the input, and the running
    statistics that evaluation uses describe no batch the model trained on. The batch size is the cause."""
    norms = run.meta.get("batchnorm")
    sizes = _finite(column(run, "batch_stats.batch_size"))
    if not isinstance(norms, list) or not norms or len(sizes) < 5 or np.median(sizes) > BN_SMALL_BATCH:
        return []
    effects = _troubles(run, (check_nonfinite, check_loss_diverging, check_exploding_gradients, check_loss_oscillating,
                              check_vanishing_gradients, check_loss_stalled, check_holdout_at_chance, check_overfitting))
    if not effects:
        return []
    st = steps(run)
    return [Finding(
        "batchnorm_small_batches", "warning",
        f"{len(norms)} BatchNorm layer(s) ({', '.join(map(str, norms[:4]))}{' and more' if len(norms) > 4 else ''}) "
        f"train on batches of {int(np.median(sizes))} examples (the median over {len(sizes)} records), and the run "
        f"shows it ({', '.join(effects)}): statistics over so few examples are noise, and the running ones that "
        "evaluation uses are not those the model trained with.", _steps_list([st[0], st[-1]]),
        hint="Train on larger batches (16 or more per device), or swap BatchNorm for GroupNorm or LayerNorm, which "
             "do not depend on the batch; fine-tuning a pretrained model on small batches, keep its BatchNorm "
             "layers in eval mode (their running statistics frozen).")]


def check_unscaled_inputs(run: Run) -> list:
    """Inputs far larger than standardised ones, in a run that blows up or whose units die or saturate: the
    scale is the cause to fix first. A run that trains well on such inputs (a normalisation layer first) is
    left alone."""
    found = _input_rms(run)
    if found is None or found[0] <= UNSCALED_RMS:
        return []
    effects = _troubles(run, (check_nonfinite, check_loss_diverging, check_exploding_gradients, check_loss_oscillating,
                              check_dead_units, check_saturated_units))
    untrained = _chance_losses(run)[0]
    first = _edge_median(column(run, "loss"), "first", 0.1)
    if untrained and first > UNSCALED_START * untrained:   # logits as large as the inputs, from the first step
        effects.append(f"a train loss of {_fmt(first)} over the first tenth of the run, {_fmt(first / untrained)}x "
                       f"the {_fmt(untrained)} of a model that knows nothing")
    else:   # the same, where the train loss fell within the first tenth: the whole holdout at its first evaluation
        h = holdout_data(run)
        held = np.flatnonzero(np.isfinite(h.loss)) if h is not None and h.loss is not None else []
        if untrained and len(held) and h.loss[held[0]] > UNSCALED_START * untrained:
            effects.append(f"a holdout loss of {_fmt(h.loss[held[0]])} at its first evaluation at step "
                           f"{int(h.steps[held[0]])}, {_fmt(h.loss[held[0]] / untrained)}x the {_fmt(untrained)} of a "
                           "model that knows nothing")
    if not effects:
        return []
    st = steps(run)
    return [Finding(
        "unscaled_inputs", "warning",
        f"the inputs (the batch's first tensor) have a root mean square of {_fmt(found[0])} per element (median "
        f"over {found[1]} batches), where standardised features or pixels in [0, 1] have about 1 or less; the "
        f"first layer's pre-activations and gradients are as large, and the run shows it ({', '.join(effects)}).",
        _steps_list([st[0], st[-1]]),
        hint="Standardise the inputs: subtract the train set's mean and divide by its standard deviation, per "
             "feature (sklearn's StandardScaler; for images ToTensor, which divides 0-255 pixels by 255, and "
             "Normalize). Lowering the learning rate only slows the damage.")]


def check_outputs_off_scale(run: Run) -> list:
    """A classifier whose outputs start far off the scale of logits, on inputs of an ordinary scale: its train
    loss over the first tenth of the run, and the holdout's at its first evaluation, over UNSCALED_START times
    log K, the loss of a model that knows nothing, where a network initialised as torch's layers are starts
    near it. The model scales its signal up before it has learned anything: weights initialised far too large
    (std 1 on wide layers), a residual added twice, a missing normalisation. Inputs off scale are
    unscaled_inputs' to name."""
    untrained = _chance_losses(run)[0]
    h = holdout_data(run)
    rms_in = _input_rms(run)
    if untrained is None or (rms_in is not None and rms_in[0] > UNSCALED_RMS):
        return []
    first = _edge_median(column(run, "loss"), "first", 0.1)
    pairs = _paired_losses(run, h)
    if not (len(pairs) >= 3 and first > UNSCALED_START * untrained and pairs[0, 1] > UNSCALED_START * untrained):
        return []
    logits = next((holdout_logits_of(r["holdout_logits"]) for r in run.records
                   if isinstance(r.get("holdout_logits"), dict) and r.get("step") == pairs[0, 2]), None)
    try:
        values = _finite(np.array(logits, dtype=float).ravel()) if logits else np.array([])
    except (TypeError, ValueError):  # ragged or not numbers: the losses say enough
        values = np.array([])
    scale = (f"; its first holdout logits have a root mean square of {_fmt(float(np.sqrt(np.mean(values ** 2))))}"
             if len(values) else "")
    inputs = f", on inputs of root mean square {_fmt(rms_in[0])}" if rms_in is not None else ""
    return [Finding(
        "outputs_off_scale", "warning",
        f"the model's outputs start far off the scale of logits{inputs}: the train loss over the first tenth of the "
        f"run is {_fmt(first)} and the holdout's at its first evaluation {_fmt(pairs[0, 1])}, "
        f"{_fmt(first / untrained)}x the {_fmt(untrained)} of a model that knows nothing, where a network "
        f"initialised as torch's layers are starts near it{scale}.", _steps_list([int(pairs[0, 2])]),
        hint="Something scales the signal up before any training: weights initialised too large (nn.init.normal_ "
             "with std 1 on wide layers; torch's default init keeps each layer's outputs near its inputs' scale), "
             "a residual or skip connection added twice, a missing normalisation layer, logits multiplied by a "
             "temperature. Fix the init or the layer, or start the last layer's weights near 0.")]


def _target_rms(run: Run) -> tuple:
    """(The root mean square of a regression holdout's targets at its last evaluation, 0 for other holdouts or
    under 5 examples; those targets, _last_targets's, empty for other holdouts)."""
    h = holdout_data(run)
    targets = _last_targets(h) if h and h.kind == "regression" else np.zeros((0, 1))
    return (float(np.sqrt(np.mean(targets ** 2))) if len(targets) >= 5 else 0.0), targets


def check_unscaled_targets(run: Run) -> list:
    """A regression's targets far from standardised ones (the holdout's, which telemetry records), in a run
    that blows up, stalls or ends no better than predicting their mean: a network's outputs start near 0, so
    the squared error's gradients are as large as the targets, and an adaptive optimizer's steps of about the
    learning rate take thousands of steps to reach them. A run that fits them anyway is left alone."""
    rms, targets = _target_rms(run)
    if rms <= UNSCALED_RMS:
        return []
    effects = _troubles(run, (check_nonfinite, check_loss_diverging, check_exploding_gradients, check_loss_oscillating,
                              check_dead_units, check_loss_stalled, check_holdout_at_chance))
    # Units killed by the first large steps, in a run whose holdout then fitted the targets and ends near
    # its best: what is left fits them (raw diabetes targets: R^2 0.62 on fresh data, over a linear fit's 0.58)
    if not effects or effects == ["dead_units"] and _holdout_improved(run):
        return []
    st = steps(run)
    return [Finding(
        "unscaled_targets", "warning",
        f"the regression targets have a root mean square of {_fmt(rms)} (mean {_fmt(float(np.mean(targets)))}, "
        f"standard deviation {_fmt(float(np.std(targets)))}, over the holdout's {len(targets)}), where standardised "
        f"ones have 1, and the run shows it ({', '.join(effects)}).", _steps_list([st[0], st[-1]]),
        hint="Standardise the targets: train on (y - mean) / std of the train targets and map the predictions back "
             "(prediction * std + mean); or start the output layer's bias at their mean. Lowering the learning "
             "rate only slows the damage.")]


def check_class_imbalance(run: Run) -> list:
    """The train batches' label shares far from balanced, or far from the holdout's."""
    found = _train_shares(run)
    if not found or len(found[0]) < 2:
        return []
    labels, shares, batches, st = found
    k, total = len(labels), int(round(_batch_counts(run)[2].sum()))
    reasons, expected = [], 1.0 / k
    hi, lo = int(np.argmax(shares)), int(np.argmin(shares))
    # Each test looks at every class, and the most uneven of k is further off than one class is: the
    # threshold that gives one class 3 sigmas' one-sided chance, shared among the k - 1 shares that are free
    # (they sum to 1: two classes are one test, and stay at 3 sigmas).
    z = statistics.NormalDist().inv_cdf(1 - (1 - statistics.NormalDist().cdf(3)) / max(k - 1, 1))
    significant = abs(shares[hi] - expected) > z * _sigma(expected, total)
    if significant and (shares[lo] <= 0 or shares[hi] / shares[lo] >= 2):
        reasons.append(f"train batches are {', '.join(f'class {c}: {v:.1%}' for c, v in zip(labels, shares))} "
                       f"over {batches} batches (balanced would be {expected:.1%} each)")
    h = holdout_data(run)
    apart, untold = None, False
    # Values the holdout's classes cannot take are no labels of its: the batch's last tensor holds something
    # else (an (inputs, labels, index) batch's example indices), and comparing its shares says nothing.
    foreign = h is not None and h.kind == "classification" and bool(h.num_classes) and any(
        v is not None and not 0 <= v < h.num_classes for v in map(_int_or_none, labels))
    if h and h.kind == "classification" and h.labels is not None and len(h.labels) >= 20 and not foreign:
        n_h, n_t = len(h.labels), _train_set_size(run)
        for c, share in zip(labels, shares):
            try:
                hs = float(np.mean(h.labels == int(c)))
            except ValueError:
                continue
            # Two samples of one distribution differ by chance: the holdout's few examples, the train set the
            # batches come from (a small one, repeated every epoch, is no larger a sample for its many
            # batches), and the labels counted in the collected batches (a run of batches of one, collected
            # every 20 steps, counts a few dozen). The spread of their difference at the pooled share, not at
            # the holdout's own share (at a share near 0 that spread vanishes), so that a 30-example holdout
            # split at random off a balanced 150-example set is not called another distribution.
            p = (share * total + hs * n_h) / (total + n_h)
            spread = math.sqrt(max(p * (1 - p), 1e-6) * (1 / n_h + 1 / max(total, 1) + (1 / n_t if n_t else 0)))
            if abs(share - hs) > max(0.15, z * spread):
                apart = f"class {c} is {share:.1%} of train batches but {hs:.1%} of the holdout"
                break
    if apart:
        reasons.append(apart)
    elif reasons:
        # Batches as uneven as the holdout (the data is imbalanced, not the sampler): that harms only where the
        # model neglects the rare classes. Class weights or a balanced sampler handle it; the holdout tells.
        neglected = _rare_classes_neglected(h, labels, shares)
        if neglected is not None:
            if not neglected[0]:
                return []
            reasons.append(neglected[1])
        else:   # the imbalance is a fact; whether it harms, the holdout cannot tell: a note
            untold = True
            reasons.append("the holdout holds too few examples of the rarer classes to tell whether the model "
                           "neglects them" if h is not None and h.kind == "classification" else
                           "no holdout tells whether the model neglects the rarer classes")
    if not reasons:
        return []
    # Only train shares far from the holdout's make the holdout look worse as the model learns them; an
    # imbalance the holdout shares says nothing about why the holdout is at chance or rising.
    hint = ("Rebalance with a WeightedRandomSampler or class weights in the loss, or check the sampler; make sure "
            "train and holdout come from the same distribution. Where the loss has class weights already, check "
            "that weight[c] is class c's (inverse counts in class-index order, not value_counts()' order).")
    severity = "info" if untold else "warning"
    if untold:
        hint = ("Where the loss already weighs the classes (CrossEntropyLoss(weight=...)) or the data is this uneven, "
                "nothing is wrong; a holdout with more examples of the rarer classes tells whether the model "
                "neglects them. Else rebalance with a WeightedRandomSampler or class weights, or check the sampler.")
    if apart and len(reasons) == 1:   # batches balanced enough, a holdout of other shares: not the sampler
        hint = ("Split the holdout off the training data at random (data sorted or grouped by class, or a holdout "
                "from another source, gives other shares); its accuracy and loss weigh the classes otherwise.")
        if all(abs(v - expected) <= 3 * _sigma(expected, total) for v in shares):
            # Batches as balanced as chance allows against an uneven holdout is also what a sampler that
            # rebalances the classes gives, by design (the fix the other case hints at): a note, not an alarm.
            severity = "info"
            reasons[0] += f" (the train batches are balanced, within chance for the {total} labels counted)"
            hint = ("If a sampler rebalances the classes (WeightedRandomSampler, oversampling), this is by design: "
                    "the holdout weighs the classes as the data does, the batches evenly. If not, split the holdout "
                    "off the training data at random (data sorted or grouped by class, or a holdout from another "
                    "source, gives other shares).")
    return [Finding("class_imbalance", severity, "; ".join(reasons) + ".", _steps_list([st[0], st[-1]]), hint=hint,
                    explains_only=None if apart else ())]


def _distinct_classes(p: np.ndarray, size: int):
    """(mean, variance) of the number of distinct classes in a batch of `size` drawn at random from class
    shares p (with replacement: a shuffled loader without replacement gives slightly more, so this errs on
    the side of calling a batch shuffled)."""
    q = (1 - p) ** size                                   # P(class c absent)
    both = np.clip(1 - p[:, None] - p[None, :], 0, 1) ** size
    cov = both - np.outer(q, q)                           # Cov(c absent, d absent), c != d
    np.fill_diagonal(cov, q * (1 - q))
    return float(np.sum(1 - q)), float(cov.sum())


def check_unshuffled_batches(run: Run) -> list:
    """Batches holding far fewer distinct classes than random batches of the same size and class shares
    would: a loader that is not shuffled over data sorted or grouped by class."""
    bc, found = _batch_counts(run), _train_shares(run)
    if not (bc and found) or len(bc[0]) < 2 or len(bc[2]) < 10:
        return []
    _, m, sizes, st = bc
    p = m.sum(axis=0) / m.sum()
    seen = (m > 0).sum(axis=1)
    stats = {int(b): _distinct_classes(p, int(b)) for b in set(sizes.tolist()) if b >= 1}
    expected = np.array([stats[int(b)][0] for b in sizes])
    # max: batches of one hold one class each, a variance of 0 that rounding can leave just below it
    se = math.sqrt(max(sum(stats[int(b)][1] for b in sizes), 0.0)) / len(sizes)
    gap = float(expected.mean() - seen.mean())
    # One-sided: 4 standard errors below what shuffling gives, and a quarter of the classes missing from
    # the average batch (a class-aware or bucketing sampler may shave off a little, by design).
    if not (gap >= 4 * se and seen.mean() <= 0.75 * expected.mean()):
        return []
    return [Finding(
        "unshuffled_batches", "warning",
        f"train batches hold {seen.mean():.2f} distinct classes on average over {len(sizes)} batches, where random "
        f"batches of that size from these class shares would hold {expected.mean():.2f} (+/- {se:.2f}): the data "
        "comes sorted or grouped by class and is not shuffled.", _steps_list([st[0], st[-1]]),
        hint="Shuffle the training data every epoch (DataLoader(shuffle=True), or a sampler that permutes the "
             "indices); a model trained one class at a time forgets the others.")]


def check_repeated_batches(run: Run) -> list:
    """The same batch again within one epoch (equal input fingerprints: sum x and sum x^2): a
    loader that hands out one batch over and over. Full-batch training is one batch per epoch, so never the
    same epoch twice; a resume replays batches, so each segment counts alone."""
    seen, repeats, fingerprints, last, adjacent = {}, [], set(), None, 0
    for r, seg in zip(run.records, segment_ids(run)):
        fp = _get(r, ["batch_stats", "fingerprint"])
        fp = tuple(_num(v) for v in fp) if isinstance(fp, list) and len(fp) == 2 else ()
        if not fp or not all(map(math.isfinite, fp)) or fp[0] == fp[1]:
            continue   # sum x == sum x^2: a 0/1 tensor (a mask) that says nothing about which examples these are
        epoch = _num(r.get("epoch"))
        key = (int(seg), math.floor(epoch) if math.isfinite(epoch) else None, fp)
        fingerprints.add(fp)
        adjacent += key == last
        last = key
        if key in seen:
            repeats.append((seen[key], r["step"]))
        else:
            seen[key] = r["step"]
    # Sums of float inputs all but never coincide for different batches: two repeats are a habit, not luck.
    # Sums of token ids are integers in a narrow range and do coincide now and then (3% of a healthy LoRA
    # run's batches): there a tenth of the batches must repeat. A batch of one example is one of the data set's
    # examples: drawn at random with replacement (an index per step), the same one comes again by chance
    # (among 100 collections from 1000 examples, 5 times on average); a loader stuck on one batch hands it
    # out at collection after collection, which chance does twice only on a small data set.
    considered = len(seen) + len(repeats)
    integral = all(v == math.floor(v) for fp in fingerprints for v in fp)
    sizes = _finite(column(run, "batch_stats.batch_size"))
    if len(repeats) < max(2, 0.1 * considered if integral else 0) or (len(sizes) and sizes.max() == 1
                                                                        and adjacent < 2):
        return []
    return [Finding(
        "repeated_batches", "warning",
        f"{len(repeats)} of {considered} collected batches repeat a batch already seen in the same epoch (equal "
        f"input fingerprints), first at step {repeats[0][1]} (seen at step {repeats[0][0]}); only "
        f"{len(fingerprints)} distinct batch(es) among them.", _steps_list([repeats[0][0]] + [s for _, s in repeats]),
        hint="Check the data loader: an iterator created once outside the loop and never advanced (next(iter(loader)) "
             "inside the loop re-creates it), a cached batch, or a sampler that yields the same indices. Full-batch "
             "training (the whole training set at every step) is one batch an epoch: pass the step as both "
             "batch_idx and epoch, on_batch_end(model, optimizer, step, step).")]


def _unit_health(run: Run, field_name: str):
    """{activation module: (share per collection, steps, kind, units)} for the activations section's `dead`
    (ReLU family) or `saturated` (sigmoid/tanh family) field."""
    out = {}
    for name in section_keys(run, "activations", skip_overall=False):
        v = column(run, ("activations", name, field_name))
        ok = np.isfinite(v)
        if ok.any():
            last = run.records[int(np.flatnonzero(ok)[-1])]["activations"][name]
            out[name] = (v[ok], steps(run)[ok], _text(last.get("kind")), _num(last.get("units")))
    return out


def _unhealthy_units(run: Run, field_name: str, threshold: float, skip=lambda name, units: False):
    """[(module, late share, first share, onset step, kind, units)] for the modules where the share stays at
    or above `threshold`: its median over the last quarter of the collections (the run's own history: a
    state the run ended in, not a moment)."""
    rows = []
    for name, (v, st, kind, units) in _unit_health(run, field_name).items():
        late = float(np.median(v[-max(1, len(v) // 4):]))
        if late >= threshold and not skip(name, units) and not (math.isfinite(units) and units * late < 2):
            rows.append((name, late, float(v[0]), int(st[np.argmax(v >= threshold)]), kind, units))
    return sorted(rows, key=lambda row: -row[1])


def _units_text(rows, what: str, n) -> str:
    return "; ".join(f"{name} ({kind}, {_fmt(units)} units): {late:.0%} {what} (from step {onset} on; {first:.0%} "
                     "at the first collection)" for name, late, first, onset, kind, units in rows[:4]) \
        + (f"; and {len(rows) - 4} more layer(s)" if len(rows) > 4 else "") \
        + (f", over the {n} holdout examples" if n else "")


# A ReLU unit fires on about half the inputs at a standard init, so one that never fires over the holdout
# is dead, not unlucky; a layer that ends with half its units dead has lost half its width (the healthy
# corpus runs stay under 25%).
DEAD_SHARE = 0.5


def check_dead_units(run: Run) -> list:
    rows = _unhealthy_units(run, "dead", DEAD_SHARE)
    if not rows:
        return []
    n = _get(run.meta, ["holdout", "examples"])
    died = [r[0] for r in rows if r[2] < DEAD_SHARE]
    if len(died) == len(rows) and check_loss_stalled(run):
        # They died while the train loss had learned nothing from the start: targets that carry no signal for
        # the inputs leave a model that outputs their mean, and units it does not need drift off. The deaths
        # follow from the stall, not the other way.
        return [Finding(
            "dead_units", "info", f"{len(rows)} ReLU layer(s) with most units dead (never firing): "
            + _units_text(rows, "dead", n) + f". {', '.join(died)} died during training, while the train loss "
            "stayed at the chance level from the start: units a model that learns nothing does not need.",
            _steps_list(sorted(r[3] for r in rows)), group=rows[0][0], explains_only=(),
            hint="Find why the loss learned nothing first (the findings above); the units are not why.")]
    rms = _target_rms(run)[0]
    # Where unscaled_targets stays quiet (the run fitted the targets after these deaths), the targets' scale is
    # still what made the first steps large: the hint says so first.
    scale = (f"The regression targets have a root mean square of {_fmt(rms)}: the outputs start near 0, so the "
             "first gradients and steps are as large as the targets; standardising them ((y - mean) / std, the "
             "predictions mapped back) keeps the steps small. " if rms > UNSCALED_RMS else "")
    when = (f" {', '.join(died)} died during training, the sign of steps too large for the layer"
            if died else f" They were dead already at the first collection (step {rows[0][3]}): the init or the "
            "biases, or a blow-up in the first steps")
    return [Finding(
        "dead_units", "warning", f"{len(rows)} ReLU layer(s) with most units dead (never firing): "
        + _units_text(rows, "dead", n) + "." + when + ".", _steps_list(sorted(r[3] for r in rows)),
        group=rows[0][0],
        hint=scale
        + ("Lower the learning rate (or warm it up, or clip gradients): units that die during training were "
           "pushed there by large updates, and dead ReLUs pass no gradient, so they never recover. "
           if died else "Check the biases and the init (Kaiming for ReLU)"
           + (f", and the learning rate: the first collection came {rows[0][3]} steps in, and a large first "
              "update kills units as surely; " if rows[0][3] > 1 else "; "))
        + "LeakyReLU/GELU or normalisation before the activation also keep units alive.")]


def check_integer_targets(run: Run) -> list:
    """A note where a regression's targets are whole numbers of a few values (3 to MAX_INTEGER_TARGETS, over the
    holdout): class indices fitted as numbers, as an ordinal target is meant to be, or as a loop that meant a
    classifier does by mistake (MSE on the labels, one output). Which it is, only the author knows."""
    h = holdout_data(run)
    if not h or h.kind != "regression":
        return []
    targets = _last_targets(h)
    if len(targets) < 5 or targets.shape[1] != 1 or not (targets == np.round(targets)).all():
        return []
    values = np.unique(targets)
    if not 3 <= len(values) <= MAX_INTEGER_TARGETS:
        return []
    return [Finding(
        "integer_targets", "info",
        f"the regression's targets are whole numbers of {len(values)} values ({_fmt(float(values[0]))} to "
        f"{_fmt(float(values[-1]))}), fitted as numbers by one output.", _steps_list(steps(run)[:1]),
        hint=f"If they name classes rather than measure an amount, a classifier fits them: {len(values)} outputs "
             "under CrossEntropyLoss, the labels as they are. A regression on class indices orders the classes and "
             "scores between them. An ordinal target (a rating, a grade) or a count is right as it is.")]


MAX_INTEGER_TARGETS = 20   # more whole-number values than this read as counts, not classes


def check_dead_output(run: Run) -> list:
    """A regression whose every holdout prediction is exactly 0 over the last quarter of its evaluations, while
    the model's last ReLU-family activation, with as many units as the model has outputs, never fires: the
    output passes through that ReLU, which cuts every negative prediction to 0 and passes no gradient where it
    does. Standardised targets are negative about half the time; once every prediction is cut, nothing trains,
    and weight decay alone shrinks the weights."""
    h = holdout_data(run)
    if h and h.kind == "classification" and len(h.raw) >= 3:
        return _logits_cut_at_zero(h)
    if not h or h.kind != "regression" or not h.raw:
        return []
    late = h.raw[-max(3, len(h.raw) // 4):]
    cut = all(isinstance(r.get("predictions"), list) and r["predictions"]
              and all(v == 0 or (isinstance(v, list) and all(x == 0 for x in v)) for v in r["predictions"])
              for r in late)
    layers = _unit_health(run, "dead")
    if not cut or not layers:
        return []
    name, (v, st, kind, units) = list(layers.items())[-1]
    outputs = _num(h.raw[-1].get("outputs", 1))
    if units != outputs or float(np.median(v[-max(1, len(v) // 4):])) < 1.0:
        return []
    return [Finding(
        "dead_output", "critical",
        f"every holdout prediction is exactly 0 over the last {len(late)} evaluations, and the model's last "
        f"activation, {name} ({kind}, {_fmt(units)} unit(s), as many as its outputs), never fires: the output "
        "passes through it, which cuts every negative prediction to 0 and passes no gradient back from there.",
        _steps_list([int(st[np.argmax(v >= 1.0)])]), group=name,
        hint="Drop the activation after the output layer: a regression's prediction is its last Linear's output. "
             "For targets that must be positive, use softplus or predict their log.")]


# A regression's predictions held inside a squashing function's range while this share of its targets lies
# outside it, by a squared distance of this share of their variance or more: the output cannot reach them.
BOUNDED_OUTSIDE = 0.25
BOUNDED_COST = 0.1
_BOUNDS = ((0.0, 1.0, "[0, 1]", "a sigmoid"), (-1.0, 1.0, "[-1, 1]", "a tanh"),
           (0.0, math.inf, "0 or more", "a ReLU or softplus"))


def check_outputs_bounded(run: Run) -> list:
    """A regression whose every holdout prediction of the last three evaluations lies in a squashing function's
    range ([0, 1], [-1, 1], or 0 and up) while BOUNDED_OUTSIDE of its targets lie outside it, far enough that
    the nearest prediction the output can give costs BOUNDED_COST of the targets' variance: an activation
    after the output layer (kept from targets in [0, 1], say) that the standardised targets outgrow."""
    h = holdout_data(run)
    if not h or h.kind != "regression" or len(h.raw) < 3:
        return []
    targets, kept = _last_targets(h), []
    for ev in h.raw[-3:]:
        values = ev.get("predictions") if isinstance(ev.get("predictions"), list) else []
        kept += [_num(v) for row in values for v in (row if isinstance(row, list) else [row])]
    predictions = np.array(kept, dtype=float)
    if not predictions.any():
        return []   # every prediction 0: dead_output's
    if len(predictions) < 10 or not np.isfinite(predictions).all() or len(targets) < 10:
        return []
    variance = _mean_variance(targets)
    for lo, hi, where, what in _BOUNDS:
        if predictions.min() < lo or predictions.max() > hi or not variance > 0:
            continue
        outside = float(np.mean((targets < lo) | (targets > hi)))
        cost = float(np.mean(np.square(targets - np.clip(targets, lo, hi)))) / variance
        # ... and the predictions press against the bound on each side the targets pass (within a twentieth of
        # the targets' spread), with a spread of their own: a model that predicts about one value for every
        # example (the targets' mean, inside the range by chance) has another cause
        spread, near = math.sqrt(variance), []
        for bound, beyond, edge in ((lo, targets < lo, predictions.min()), (hi, targets > hi, predictions.max())):
            if math.isfinite(bound) and beyond.mean() >= 0.05:
                near.append(abs(edge - bound) <= 0.05 * spread)
        if outside < BOUNDED_OUTSIDE or cost < BOUNDED_COST or not all(near) or predictions.std() < 0.1 * spread:
            return []
        return [Finding(
            "outputs_bounded", "warning",
            f"every holdout prediction of the last three evaluations (steps {int(h.steps[-3])}-{int(h.steps[-1])}) "
            f"lies in {where}, while {outside:.0%} of the targets lie outside it (from {_fmt(float(targets.min()))} "
            f"to {_fmt(float(targets.max()))}): the output passes through an activation of that range ({what}), "
            f"and the nearest predictions it can give cost {cost:.0%} of the targets' variance.",
            _steps_list([int(h.steps[-3])]),
            hint="Drop the activation after the output layer (a regression's prediction is its last Linear's output), "
                 "or scale the targets into its range and the predictions back.")]
    return []


LOGITS_CUT = 0.3   # logits exactly 0 (none below) at this share or more: a Linear's outputs are never 0 so often


def _logits_cut_at_zero(h: Holdout) -> list:
    """dead_output for a classifier: none of the holdout's logits below 0 and LOGITS_CUT of them or more exactly 0,
    at each of the last three evaluations. The logits pass through a ReLU (a loop of [Linear, ReLU] blocks adds
    one after the last): a class whose logit falls below 0 gets no gradient back, and no class can be ruled out
    below the others."""
    shares = []
    for ev in h.raw[-3:]:
        z = holdout_logits_of(ev)
        try:
            z = np.array(z, dtype=float) if z is not None else None
        except (ValueError, TypeError, OverflowError):
            return []
        if z is None or z.ndim != 2 or z.shape[1] < 2 or not z.size or not np.isfinite(z).all() or z.min() < 0:
            return []
        shares.append(float((z == 0).mean()))
    if min(shares) < LOGITS_CUT:
        return []
    return [Finding(
        "dead_output", "warning",
        f"none of the holdout's logits is below 0, and {min(shares):.0%} or more of them are exactly 0 at each of "
        f"its last three evaluations (steps {int(h.steps[-3])}-{int(h.steps[-1])}): the logits pass through a ReLU "
        "(or a clamp at 0), which passes no gradient back where it cuts, so a class cannot be ruled out below 0.",
        _steps_list([int(h.steps[-3])]),
        hint="Drop the activation after the output layer: CrossEntropyLoss takes the last Linear's output as it is "
             "(a loop that builds [Linear, ReLU] blocks adds one after the last one too).")]


# A unit on a flat end (|tanh| > 0.99, sigmoid outside 0.01-0.99) passes under 2% of the gradient; at a
# standard init only a few percent of the outputs sit there. A quarter of a layer's outputs there is a
# layer learning at a crawl.
SATURATED_SHARE = 0.25


def check_saturated_units(run: Run) -> list:
    h = holdout_data(run)
    classes = (h.num_classes if h and h.num_classes else 2) if h else 2
    layers = list(_unit_health(run, "saturated"))
    # The model's output squashed by a sigmoid is meant to sit at 0 or 1 once the model is sure.
    output = lambda name, units: name == (layers[-1] if layers else None) and units <= classes  # noqa: E731
    rows = _unhealthy_units(run, "saturated", SATURATED_SHARE, output)
    # The layer before the output head (a transformer's tanh pooler) saturating as the holdout gets better is
    # the model growing sure of its examples, not a layer that cannot train: it did not start that way, nor get
    # there in the first tenth of the run (steps too large put it there at once).
    st = steps(run)
    settled = st[0] + 0.1 * (st[-1] - st[0]) if len(st) else math.inf
    if rows and _holdout_improved(run):
        rows = [r for r in rows if not (r[0] == layers[-1] and r[2] < SATURATED_SHARE and r[3] >= settled)]
    if not rows:
        return []
    n = _get(run.meta, ["holdout", "examples"])
    return [Finding(
        "saturated_units", "warning", f"{len(rows)} sigmoid/tanh layer(s) with a large share of outputs on a flat "
        "end: " + _units_text(rows, "saturated", n) + ".", _steps_list(sorted(r[3] for r in rows)), group=rows[0][0],
        hint="Saturated units pass almost no gradient: scale the init down (Xavier for tanh/sigmoid), normalise the "
             "inputs and add normalisation before the activation, or lower the learning rate.")]


def check_lora(run: Run) -> list:
    if not any(isinstance(r.get("lora"), dict) for r in run.records):
        return []
    st = steps(run)
    has = np.array([isinstance(r.get("lora"), dict) for r in run.records])
    idx = np.where(has)[0][1:]   # B is zero-initialised, so the first collection tells nothing
    if len(idx) < 2:
        return []
    bz = _finite(column(run, "lora.b_zero_fraction")[idx])
    an = _finite(column(run, "lora.adapter_norm.overall")[idx])
    gb = column(run, "lora.grad_norm_B")[idx]
    reasons = []
    if len(bz) >= 2 and np.all(bz >= 0.999):
        reasons.append(f"b_zero_fraction stayed {_fmt(float(np.min(bz)))} (every LoRA B exactly zero)")
    if len(an) >= 2 and np.all(an == 0):
        reasons.append("adapter_norm stayed 0")
    if np.all(~np.isfinite(gb) | (gb == 0)):
        reasons.append("grad_norm_B was 0 or absent")
    if not reasons or len(reasons) == 1 and reasons[0].startswith("grad_norm_B"):
        return []
    still = [g for g in _lr_zero_groups(run) if "lora" in g.lower()]
    why = f"; its groups {', '.join(still)} have learning rate 0" if still else ""
    return [Finding(
        "lora_not_learning", "critical",
        f"the LoRA adapter does not learn: {' and '.join(reasons)} over {len(idx)} collections from step "
        f"{int(st[idx[0]])} to {int(st[idx[-1]])}{why}.", _steps_list([st[idx[0]], st[idx[-1]]]),
        hint="Make sure the optimizer was built from the PEFT model's parameters (after get_peft_model), the LoRA "
             "params have requires_grad=True and lr > 0, and that gradients reach them.")]


def check_telemetry_alerts(run: Run) -> list:
    """The alerts telemetry.py raised while training, one finding per (code, group), at the worst
    severity seen; they keep the writer's codes."""
    alerts = {}
    for r in run.records:
        for a in r.get("alerts") or []:
            if not isinstance(a, dict) or not isinstance(a.get("code"), str) or not a["code"]:
                continue
            key = (a["code"], a.get("group") if isinstance(a.get("group"), str) else None)
            entry = alerts.setdefault(key, {"steps": [], "message": _text(a.get("message", ""), 2000),
                                            "severity": "info"})
            sev = a.get("severity") if a.get("severity") in SEVERITIES else "warning"
            if SEVERITIES.index(sev) > SEVERITIES.index(entry["severity"]):
                entry["severity"] = sev
            entry["steps"].append(r["step"])
    return [Finding(
        code, a["severity"],
        f"telemetry alert at step {a['steps'][0]}" + (f" (group '{group}')" if group else "") + f": {a['message']}"
        + (f" (raised {len(a['steps'])} times)" if len(a["steps"]) > 1 else ""),
        _steps_list(a["steps"]), group=group, source="telemetry",
        hint="Raised by telemetry.py while training; see the matching analyzer finding if there is one.")
        for (code, group), a in alerts.items()]


def _section_errors(run: Run) -> dict:
    """{section: {"rows": record indices, "steps": their steps, "message": the first error}} from the
    records' `errors` ({section: "ErrorType: message"}: telemetry.py records a failing section there
    and goes on without it)."""
    errors = {}
    for i, r in enumerate(run.records):
        errs = r.get("errors")
        if isinstance(errs, dict):
            for section, text in errs.items():
                e = errors.setdefault(section, {"rows": [], "steps": [], "message": _text(text, 2000)})
                e["rows"].append(i)
                e["steps"].append(r["step"])
    return errors


# layout: the trainable parameters and their groups, which every section read from the parameters needs
CORE_SECTIONS = ("holdout_logits", "gradient_norm", "weight_delta", "layout")


def _failed_everywhere(run: Run, errors: dict) -> list:
    """The core sections that failed at every collection where they were expected: every record,
    except for weight_delta the first of each segment (no reference to compare with yet)."""
    out = []
    for section in CORE_SECTIONS:
        if section not in errors:
            continue
        failed = np.zeros(len(run.records), dtype=bool)
        failed[errors[section]["rows"]] = True
        expected = np.ones(len(run.records), dtype=bool)
        if section == "weight_delta":
            expected[[p[0] for p in _pieces(segment_ids(run))]] = False
        if expected.any() and failed[expected].all():
            out.append(section)
    return out


def check_section_failed(run: Run) -> list:
    errors = _section_errors(run)
    return [Finding(
        "section_failed", "critical",
        f"{section} failed at every collection ({len(errors[section]['rows'])} of {len(run.records)} records), "
        f"first at step {errors[section]['steps'][0]}: {errors[section]['message']}",
        _steps_list(errors[section]["steps"]), group=section,
        hint="Fix the cause shown: telemetry.py records a failing section and goes on without it, so this run "
             "has none of it. Run with strict=True to get the traceback.")
        for section in _failed_everywhere(run, errors)]


def check_metric_errors(run: Run) -> list:
    errors = _section_errors(run)
    for section in _failed_everywhere(run, errors):
        del errors[section]   # check_section_failed's finding
    if not errors:
        return []
    parts = [f"{s} failed in {len(e['steps'])} record(s) from step {e['steps'][0]} ({e['message']})"
             for s, e in errors.items()]
    return [Finding(
        "metric_errors", "warning", "; ".join(parts) + ". Those sections are missing from those records.",
        _steps_list(sorted(s for e in errors.values() for s in e["steps"])),
        hint="Fix the cause shown (often a batch format telemetry did not understand: pass batch_label_key, "
             "or a holdout forward); run with strict=True to get the traceback.")]


# Every analyzer check, one finding code each; telemetry's alerts come last so that they can fold into
# the analyzer's finding on the same problem.
CHECKS = (check_section_failed, check_optimizers_in_turn, check_restart_from_scratch, check_weights_rolled_back,
          check_gradients_never_zeroed, check_batches_skipped, check_accumulation_discarded, check_missing_gradients,
          check_unregistered_parameters, check_not_in_optimizer, check_frozen_parameters, check_lr_zero,
          check_lr_collapsed, check_lr_below_base,
          check_low_precision_updates, check_adam_eps_dominates, check_adam_betas_unstable,
          check_lr_schedule_restarted, check_dropout_too_high,
          check_ignored_group_key, check_softmax_over_batch, check_probability_outputs, check_lora,
          check_frozen_groups, check_eval_mode,
          check_negative_loss, check_train_loss_near_zero, check_constant_inputs, check_future_visible,
          check_eval_random, check_examples_mixed, check_padding_read,
          check_labels_not_shifted, check_labels_shifted_twice,
          check_gradients_clipped, check_integer_targets, check_dead_output, check_outputs_bounded, check_gradient_cut,
          check_weights_collapsed, check_not_learning,
          check_holdout_off_scale, check_holdout_in_training, check_repeated_batches, check_unshuffled_batches,
          check_padding_supervised, check_holdout_positions_untrained, check_unscaled_inputs, check_outputs_off_scale,
          check_unscaled_targets,
          check_batchnorm_stats_at_init, check_batchnorm_small_batches,
          check_class_imbalance, check_class_never_predicted, check_nonfinite, check_loss_diverging,
          check_loss_spikes, check_exploding_gradients, check_loss_oscillating, check_dead_units,
          check_saturated_units, check_vanishing_gradients,
          check_loss_stalled, check_holdout_at_chance, check_overfitting, check_forgetting, check_telemetry_alerts,
          check_metric_errors)


CHECK_FAILED = "analysis check failed:"   # the notice for a check that raised (a bug in this file)


# ---- Root cause first -----------------------------------------------------------------------------------
# The chain from cause to symptom, in stages: what is set up wrong (the gradients never read, parameters
# that cannot train, inputs far off the scale a network expects), then what the data does, then numerical
# blow-ups, then the state of the model's units, then how the loss moves, and last how the holdout looks. A
# finding's stage decides its rank; a finding that a higher-ranked one explains (CONSEQUENCES) is listed
# under it, not beside it.
STAGES = (
    ("section_failed", "optimizers_in_turn", "restart_from_scratch", "weights_rolled_back", "gradients_never_zeroed",
     "batches_skipped", "accumulation_discarded", "missing_gradients", "unregistered_parameters", "not_in_optimizer",
     "frozen_parameters", "lr_zero",
     "lora_not_learning", "lr_collapsed", "lr_below_base", "low_precision_updates", "adam_eps_dominates",
     "adam_betas_unstable",
     "lr_schedule_restarted", "dropout_too_high",
     "batchnorm_stats_at_init", "batchnorm_small_batches",
     "ignored_group_key", "softmax_over_batch", "probability_outputs", "unscaled_inputs", "outputs_off_scale",
     "unscaled_targets",
     "eval_mode", "negative_loss",
     "constant_inputs", "future_visible", "eval_random", "examples_mixed", "padding_read", "labels_not_shifted",
     "labels_shifted_twice", "gradients_clipped",
     "integer_targets", "dead_output", "outputs_bounded", "gradient_cut",
     "train_loss_near_zero", "weights_collapsed", "not_learning"),
    ("holdout_off_scale", "holdout_in_training", "repeated_batches", "unshuffled_batches", "padding_supervised",
     "holdout_positions_untrained", "class_imbalance", "class_never_predicted", "holdout_below_chance"),
    ("nonfinite", "loss_diverging", "loss_spike", "exploding_gradients", "loss_oscillating"),
    # a group that stands still for a reason the records do not name: after a blow-up, dead units do that
    ("dead_units", "saturated_units", "vanishing_gradients", "frozen_group"),
    # A holdout at chance says more than a train loss stalled at chance (labels that carry no signal for the
    # inputs show in both), so it comes first and takes the stalled loss under it.
    ("holdout_at_chance", "loss_stalled", "overfitting", "forgetting"),
)
# Every finding code with the severities its check gives it, where it comes from (this file's checks, or
# telemetry.py's alerts while training) and what it means. The README's table is tested against it, and
# tests/test_readme.py checks that every code this file or telemetry.py emits is here. A cause also takes
# the highest severity among the findings it explains.
FINDINGS = {
    "section_failed": (("critical",), "analyzer", "a telemetry section failed at every collection, so the "
                       "run has none of it (the records' errors name why)"),
    "optimizers_in_turn": (("warning",), "analyzer", "on_batch_end called after each of several optimizers in turn: "
                           "each record holds one optimizer's groups (pass them as a list, once per step)"),
    "restart_from_scratch": (("warning",), "analyzer", "a restart whose weights are not the ones the run left (10x "
                             "the usual change, the holdout loss back where the run began): another training "
                             "written into the same run directory"),
    "weights_rolled_back": (("warning",), "analyzer", "the weights went back toward their start between two "
                            "collections and the train loss rose with them: something outside the optimizer "
                            "overwrote them (an EMA copy swapped in for evaluation and never out)"),
    "gradients_never_zeroed": (("warning",), "analyzer", "the same gradient tensors change once per step in "
                               "place: backward() adds into them and nothing zeroes them (or zero_grad() runs only "
                               "every few steps)"),
    "batches_skipped": (("warning",), "analyzer", "a fifth of the batches or more never reach an optimizer step, "
                        "at a rate that varies: the loop skips them (a guard on a NaN loss) and trains on the rest"),
    "accumulation_discarded": (("warning",), "analyzer", "the optimizer steps every k batches, but its gradients "
                               "hold fewer backward() passes: zero_grad() between the micro-batches of gradient "
                               "accumulation"),
    "missing_gradients": (("warning", "critical"), "analyzer", "gradients absent when the hook ran: it was "
                          "called after zero_grad, or a group never gets a gradient"),
    "adam_eps_dominates": (("warning",), "analyzer", "an Adam-like optimizer's eps is many times its gradients' "
                           "size per element: its steps shrink from lr-sized to lr x gradient / eps"),
    "batchnorm_stats_at_init": (("warning",), "analyzer", "BatchNorm layers with momentum=0 keep their initial "
                                "running statistics, which evaluation normalises with: the holdout scores far "
                                "worse than training"),
    "adam_betas_unstable": (("warning",), "analyzer", "an Adam-like optimizer's beta1 is not below sqrt(beta2) "
                            "(betas swapped) and the weights grew many times over"),
    "unregistered_parameters": (("warning",), "analyzer", "trainable layers held in a plain Python list or dict, "
                                "not nn.ModuleList: no parameters of the model, so the optimizer never steps them"),
    NOT_IN_OPTIMIZER: (("warning",), "analyzer", "trainable tensors that no optimizer group holds: they never "
                       "change"),
    "frozen_parameters": (("warning", "critical"), "analyzer", "requires_grad is off for a share of a group "
                          "whose learning rate is above 0"),
    "lora_not_learning": (("critical",), "analyzer", "a LoRA adapter stays at zero (B never leaves 0)"),
    "lr_zero": (("warning", "critical"), "both", "a group's learning rate is 0 while others train, or every "
                "group's"),
    "lr_collapsed": (("warning",), "analyzer", "the learning rate fell below 1/1000 of its peak in the first half "
                     "of the run and stayed there"),
    "lr_below_base": (("warning",), "analyzer", "every learning rate stayed under 1/20 of the lr its scheduler "
                      "started from, over the whole run (a warmup that never ends)"),
    "low_precision_updates": (("warning",), "analyzer", "the optimizer steps bfloat16 or float16 weights itself "
                              "(no float32 master copy) at a learning rate under half their spacing at the typical "
                              "weight's size: those updates round to nothing"),
    "dropout_too_high": (("warning",), "analyzer", "dropout layers drop 80% or more of their inputs and the train "
                         "loss stays far above the holdout's: p is the share dropped, not kept (keep_prob)"),
    "lr_schedule_restarted": (("warning",), "analyzer", "a OneCycleLR's learning rate fell back to its start and "
                              "climbed again, twice or more: the scheduler was created anew (each epoch), and its "
                              "annealing never came"),
    "ignored_group_key": (("warning",), "analyzer", "a param-group key the optimizer never reads, spelt like one "
                          "it does (learning_rate for lr): that setting was never applied"),
    "eval_mode": (("warning",), "analyzer", "the model trains in eval mode (model.eval() for validation and no "
                  "model.train() after it): its dropout is off and its BatchNorm statistics frozen"),
    "negative_loss": (("critical",), "analyzer", "a classifier's train loss falls below 0 and on without bound: "
                      "NLLLoss on raw outputs, not log-probabilities, or binary targets above 1; or any loss falls "
                      "below 0 by a million times its start: a term with its sign flipped (a VAE's KL subtracted)"),
    "future_visible": (("critical",), "analyzer", "a language model sees the tokens it predicts: its predictions "
                       "changed at earlier positions when only the last input token did (no causal mask)"),
    "eval_random": (("warning",), "analyzer", "the model's outputs in eval() mode change between two passes over "
                    "the same batch: something random stays on at evaluation (F.dropout without "
                    "training=self.training)"),
    "examples_mixed": (("warning",), "analyzer", "an example's outputs change with the order of the other examples "
                       "in its batch: the model mixes examples along the batch axis (an RNN without batch_first)"),
    "padding_read": (("warning",), "analyzer", "a language model scores the tokens of a padded holdout row "
                     "otherwise than the row alone: its attention reads the padding as context (a forward that "
                     "drops attention_mask), or its positions count it"),
    "labels_not_shifted": (("critical",), "analyzer", "a language model predicts the token at each position, "
                           "not the next: the loss scores positions against their own tokens, and it learns to "
                           "copy its input"),
    "labels_shifted_twice": (("critical",), "analyzer", "a language model predicts the token after the next one: "
                             "its labels were shifted already and shifted again by the model or the loss"),
    "constant_inputs": (("critical",), "analyzer", "every batch's inputs hold one value (all zeros, say): the model "
                        "cannot tell the examples apart"),
    "gradients_clipped": (("warning",), "analyzer", "every step's gradients are clipped to one small norm and the "
                          "train loss never falls: clip_grad_norm_'s max_norm is too small"),
    "integer_targets": (("info",), "analyzer", "a regression's targets are whole numbers of a few values: class "
                        "indices fitted as numbers (right for an ordinal target, a mistake for classes)"),
    "dead_output": (("warning", "critical"), "analyzer", "every regression prediction is 0: the output passes "
                    "through a ReLU that never fires (critical); a classifier's logits pass through a ReLU"),
    "outputs_bounded": (("warning",), "analyzer", "a regression's predictions stay in a sigmoid's, tanh's or "
                        "ReLU's range while many of its targets lie outside it: an activation after the output layer"),
    "holdout_positions_untrained": (("warning", "critical"), "analyzer", "a language model's holdout is scored on "
                                    "a far larger share of positions than the training supervises: it measures "
                                    "what the training never teaches"),
    "train_loss_near_zero": (("critical",), "analyzer", "a classifier's train loss starts far below its holdout's "
                             "and falls to near 0 as the holdout only worsens: the loss does not score predictions "
                             "against labels (a focal loss's weight inverted)"),
    "gradient_cut": (("critical",), "analyzer", "some layers get exactly no gradient from the first step on while "
                     "others do: something multiplies it by 0 on the way back (a frozen layer of zeros, a loss "
                     "term weighted 0)"),
    "weights_collapsed": (("critical",), "analyzer", "the weights shrink toward 0 while the train loss learns "
                          "nothing: weight decay (or an L2 penalty) outweighs the loss's gradient"),
    "not_learning": (("critical",), "analyzer", "the weights barely move, or not at all"),
    "outputs_off_scale": (("warning",), "analyzer", "a classifier's first losses, train and holdout, are many times "
                          "an untrained model's on inputs of an ordinary scale: an init or a layer scales its "
                          "outputs up"),
    "softmax_over_batch": (("warning",), "analyzer", "the train loss starts at the log of the batch size, not of "
                           "the classes, and stays far above the holdout's: its softmax runs over the batch (dim=0)"),
    "probability_outputs": (("warning",), "analyzer", "the model's outputs are probabilities, and the train loss "
                            "stays at the floor CrossEntropyLoss or BCEWithLogitsLoss has on them: a softmax or "
                            "sigmoid before a loss that applies its own"),
    "holdout_off_scale": (("warning",), "analyzer", "the holdout's inputs are on another scale than the training "
                          "batches' (4x or more), and it reads at chance: it skipped their preprocessing"),
    "holdout_in_training": (("warning",), "analyzer", "training examples are holdout examples (2% or more of "
                            "those looked up, and 3x what the holdout's own repeated inputs predict): the "
                            "holdout was drawn from the training data"),
    "repeated_batches": (("warning",), "analyzer", "the same inputs come back within an epoch (equal "
                         "fingerprints)"),
    "unshuffled_batches": (("warning",), "analyzer", "far fewer classes per batch than shuffling gives"),
    "padding_supervised": (("warning",), "analyzer", "a language model's padding positions have labels: the loss "
                           "trains it to predict padding"),
    "unscaled_inputs": (("warning",), "analyzer", "the inputs are far larger than standardised ones (root mean "
                        "square over 10), and the run blows up, its units die or saturate, or its first losses are "
                        "many times an untrained model's"),
    "unscaled_targets": (("warning",), "analyzer", "a regression's targets are far from standardised ones (root "
                         "mean square over 10), and the run blows up, stalls or ends no better than their mean"),
    "class_imbalance": (("info", "warning"), "analyzer", "the batches' label shares are far from even, or from "
                        "the holdout's (a note where the batches are balanced and the holdout is not, as a sampler "
                        "that rebalances the classes makes them, or where no holdout tells whether the rarer "
                        "classes are neglected)"),
    "nonfinite": (("critical",), "both", "NaN or Inf in the loss, gradients or weights (the gradients of steps a "
                                         "GradScaler skipped only when it skips most)"),
    "loss_diverging": (("info", "warning"), "analyzer", "the training loss grows over the run (a note where "
                       "several optimizers step together, as a GAN's do: the loss given may be one player's)"),
    "loss_spike": (("warning",), "both", "the loss jumps far outside its rolling noise band"),
    "exploding_gradients": (("warning",), "analyzer", "the gradient norm jumps to many times its median, or "
                            "grows 10x, while the loss does not fall through it"),
    "grad_spike": (("info", "warning"), "telemetry", "alert: the gradient norm far outside its rolling noise band "
                   "(not while the loss falls through its own); a note where the whole run shows no blow-up"),
    "grad_explosion": (("info", "critical"), "telemetry", "alert: the gradient norm many times its rolling median "
                       "(not while the loss falls through its own noise band); a note where it was raised once and "
                       "the whole run shows no blow-up"),
    "loss_oscillating": (("warning",), "analyzer", "the loss swings up and down instead of falling"),
    "dead_units": (("info", "warning"), "analyzer", "ReLU units that never fire on the holdout"),
    "saturated_units": (("warning",), "analyzer", "tanh/sigmoid units stuck at their limits on the holdout"),
    "vanishing_gradients": (("warning",), "analyzer", "the first layers' gradients are tiny against the last "
                            "ones'"),
    "frozen_group": (("warning", "critical"), "both", "a group stands still while others move, for a reason "
                     "the records do not name"),
    "holdout_at_chance": (("critical",), "analyzer", "the holdout's accuracy or loss stays at chance (a language "
                          "model's: no better than its tokens' frequencies)"),
    "batchnorm_small_batches": (("warning",), "analyzer", "BatchNorm layers train on batches of 4 examples or "
                                "fewer, and the run blows up, stalls, overfits or ends at chance"),
    "class_never_predicted": (("warning",), "analyzer", "a class the training batches hold as often as the others "
                              "is never predicted on the holdout, where the others mostly are: the loss skips it "
                              "(ignore_index set to a real class, a class weight of 0)"),
    "holdout_below_chance": (("critical",), "analyzer", "the holdout's accuracy stays below chance: the model "
                             "learned to pick wrong classes (labels apart from their inputs, a loss maximised)"),
    "loss_stalled": (("warning",), "analyzer", "the training loss stopped falling well above where it "
                     "could be"),
    "overfitting": (("warning",), "analyzer", "the holdout loss rises from its best while the training loss "
                    "falls"),
    "forgetting": (("info", "warning"), "analyzer", "holdout examples right at the holdout's best are wrong at "
                   "the end, more than churn explains"),
    "metric_errors": (("warning",), "analyzer", "a section or custom metric failed at some collections"),
}
BLOWUPS = STAGES[2]   # events in time: they explain only what starts at or after them
_AFTER_A_BLOWUP = BLOWUPS + STAGES[3] + ("not_learning",) + STAGES[4]
# Parameters that cannot train leave the rest of the model to learn what it can: it may not be enough.
# A part that never trains may hold zeros (a zero-initialised head) that pass no gradient to what is before it.
_UNTRAINED_PART = ("frozen_group", "gradient_cut", "holdout_at_chance", "loss_stalled", "forgetting")
# Inputs or targets far off scale blow a run up, kill or saturate its units and stall it from the start; a
# lone loss spike is one batch's doing, not theirs.
_OFF_SCALE = tuple(c for c in _AFTER_A_BLOWUP if c != "loss_spike")
CONSEQUENCES = {
    # every step applies the sum of the gradients so far: steps that grow with the run, and all that follows
    "gradients_never_zeroed": _AFTER_A_BLOWUP,
    # a skipped batch's gradients zeroed between two steps read as micro-batches thrown away
    "batches_skipped": ("accumulation_discarded",),
    # a batch k times smaller than meant, at the lr chosen for the whole one: noisier steps
    "accumulation_discarded": ("loss_oscillating", "loss_spike", "exploding_gradients", "loss_diverging"),
    "missing_gradients": ("frozen_group", "exploding_gradients", "vanishing_gradients"),
    "frozen_parameters": _UNTRAINED_PART,
    # one group at lr 0 leaves the others to learn; every group at lr 0 (no group named) moves nothing; a LoRA
    # adapter's B at lr 0 stays at its zero start
    "lr_zero": _UNTRAINED_PART + ("not_learning", "lora_not_learning"),
    # a LoRA adapter that does not learn while some tensors are in no optimizer group: they are its own
    "not_in_optimizer": _UNTRAINED_PART + ("lora_not_learning",),
    # layers that keep their initial weights: the model learns only what the others can, slowly
    "unregistered_parameters": _UNTRAINED_PART + ("not_learning",),
    # steps far smaller than the learning rate says: a run that learns slowly or not at all
    "adam_eps_dominates": _UNTRAINED_PART + ("not_learning", "vanishing_gradients", "lr_below_base"),
    # steps that outgrow the learning rate: what a blow-up brings
    "adam_betas_unstable": _AFTER_A_BLOWUP + ("outputs_off_scale",),
    # a holdout scored with the wrong normalisation: it looks worse than the model is, and gets worse as the
    # activations move away from 0 and 1
    "batchnorm_stats_at_init": ("holdout_at_chance", "overfitting", "forgetting", "holdout_off_scale"),
    # a holdout scored through noise looks worse than the model, and worse than the train loss
    "eval_random": ("overfitting", "forgetting", "holdout_at_chance"),
    # a model that reads other examples for each one learns slowly and predicts what the batch makes it
    "examples_mixed": ("holdout_at_chance", "overfitting", "forgetting", "loss_stalled", "not_learning"),
    # a holdout scored through its padding looks worse than the model, and so does a model trained through it
    "padding_read": ("overfitting", "forgetting", "holdout_at_chance", "loss_stalled"),
    "lora_not_learning": ("frozen_group", "not_learning", "loss_stalled"),
    "not_learning": ("loss_stalled", "holdout_at_chance", "overfitting", "forgetting"),
    # each record sees one optimizer: the others' tensors are in none, the batch is passed twice, deltas restart
    "optimizers_in_turn": ("not_in_optimizer", "repeated_batches", "frozen_group", "frozen_parameters",
                           "missing_gradients", "gradient_cut", "not_learning", "loss_spike", "loss_oscillating",
                           "exploding_gradients", "weights_rolled_back"),
    # a model that starts again from fresh weights forgets what the holdout had learned
    "restart_from_scratch": ("forgetting", "overfitting", "loss_spike"),
    # the loss climbs back where it was, and what the holdout had learned since is undone
    "weights_rolled_back": ("loss_spike", "loss_oscillating", "loss_diverging", "loss_stalled", "forgetting",
                            "overfitting"),
    # no dropout: nothing holds back memorising the train set
    "eval_mode": ("overfitting", "forgetting"),
    # a loss without a floor: the outputs, the gradients and the holdout's loss grow without end
    "negative_loss": _AFTER_A_BLOWUP + ("holdout_at_chance", "overfitting", "forgetting"),
    # a model that copies its input fits its train loss, and its next-token holdout gets worse as it does
    "labels_not_shifted": ("overfitting", "forgetting", "holdout_at_chance", "loss_diverging"),
    # trained for another token than the one scored: the holdout is near chance, or grows worse
    "labels_shifted_twice": ("overfitting", "forgetting", "holdout_at_chance", "loss_stalled", "not_learning"),
    # a model that reads the answer: a train loss near 0, and a holdout that says nothing of generation
    "future_visible": ("overfitting", "forgetting", "holdout_at_chance", "train_loss_near_zero", "loss_diverging"),
    # inputs that carry nothing: only the label shares can be learned, and units sit wherever their biases put them
    "constant_inputs": ("not_learning", "loss_stalled", "holdout_at_chance", "forgetting", "dead_units",
                        "saturated_units", "vanishing_gradients"),
    # a holdout the model cannot read: its scores are at chance, its loss high and jumpy, and the units' states
    # measured on it (dead, saturated) are those of inputs the model never trains on
    "holdout_off_scale": ("holdout_at_chance", "overfitting", "forgetting", "loss_oscillating", "dead_units",
                          "saturated_units"),
    # steps of a fixed, tiny size: the weights stay where they started
    "gradients_clipped": ("not_learning", "loss_stalled", "holdout_at_chance", "forgetting"),
    # no gradient passes the cut output: nothing trains, weight decay alone shrinks the weights, the units die
    # predictions that cannot reach the targets: what the holdout and the squashed units show follows
    "outputs_bounded": ("holdout_at_chance", "loss_stalled", "saturated_units", "dead_units", "vanishing_gradients",
                        "overfitting", "forgetting"),
    "dead_output": ("weights_collapsed", "not_learning", "loss_stalled", "holdout_at_chance", "forgetting",
                    "vanishing_gradients", "dead_units", "unscaled_targets", "class_never_predicted"),
    # a loss that asks nothing of the predictions: what the model does with its units and the holdout follows
    "train_loss_near_zero": ("holdout_at_chance", "overfitting", "forgetting", "dead_units", "saturated_units",
                             "loss_stalled", "not_learning", "vanishing_gradients", "weights_collapsed"),
    # scored where the training never teaches, the holdout shows no learning, or a loss that rises apart from it
    "holdout_positions_untrained": ("holdout_at_chance", "overfitting", "forgetting"),
    # the layers cut off keep only what weight decay does to them, and the model learns with what is left
    # (a head whose loss term counts 0 leaves a total loss of the other heads, near 0 while it is at chance)
    "gradient_cut": ("weights_collapsed", "not_learning", "frozen_group", "loss_stalled", "holdout_at_chance",
                     "forgetting", "unscaled_targets", "vanishing_gradients", "dead_units", "train_loss_near_zero"),
    # weights near 0 give about the same output for every input, and small gradients to the early layers
    "weights_collapsed": ("not_learning", "loss_stalled", "holdout_at_chance", "forgetting", "vanishing_gradients",
                          "dead_units"),
    "repeated_batches": ("class_imbalance", "loss_spike", "exploding_gradients") + STAGES[4],
    "unshuffled_batches": ("class_imbalance",) + BLOWUPS + STAGES[3] + STAGES[4],
    # a model whose units died or that blew up neglects the rare classes as it neglects everything else
    "unscaled_inputs": _OFF_SCALE + ("class_imbalance",),
    "unscaled_targets": _OFF_SCALE,
    "outputs_off_scale": _OFF_SCALE + ("class_imbalance",),
    "lr_collapsed": _UNTRAINED_PART + ("not_learning",),
    "lr_below_base": _UNTRAINED_PART + ("not_learning",),
    # most weights never move: the loss falls slowly, on what the smallest weights can do
    "low_precision_updates": _UNTRAINED_PART + ("not_learning",),
    # most of each layer's inputs dropped: the training fits slowly, and no better than the dropout lets it
    "dropout_too_high": ("loss_stalled", "not_learning"),
    # noisy batch statistics: noisy steps, and a holdout scored with running statistics no batch had
    "batchnorm_small_batches": _AFTER_A_BLOWUP,
    # a warmup begun again and again: the lr saws below its peak and never anneals
    "lr_schedule_restarted": ("loss_stalled", "loss_oscillating"),
    # a loss capped above 0 reads as one that stopped falling; squashed gradients reach the first layers faintly
    "probability_outputs": ("loss_stalled", "not_learning", "vanishing_gradients"),
    # a loss that cannot reach the labels' level: it stalls high, and reads as a gap to the holdout
    "softmax_over_batch": ("loss_stalled", "not_learning", "vanishing_gradients", "dropout_too_high"),
    # train batches drawn from other label shares than the holdout's: its loss gets worse as the model
    # learns the train shares
    "class_imbalance": ("holdout_at_chance", "overfitting", "forgetting", "class_never_predicted"),
    **dict.fromkeys(BLOWUPS, _AFTER_A_BLOWUP),
    # layers that never get a gradient, inside a group that trains, are parameters that cannot train as well
    "frozen_group": ("holdout_at_chance", "loss_stalled", "forgetting"),
    "dead_units": ("vanishing_gradients", "frozen_group", "loss_stalled", "holdout_at_chance", "forgetting"),
    "saturated_units": ("vanishing_gradients", "loss_stalled", "holdout_at_chance", "forgetting"),
    "vanishing_gradients": ("loss_stalled", "holdout_at_chance", "forgetting"),
    "holdout_at_chance": ("loss_stalled", "overfitting", "forgetting"),
    # taught to avoid the right class (a loss maximised), the loss and the gradients go where that leads them
    "holdout_below_chance": ("loss_diverging", "loss_spike", "exploding_gradients", "loss_oscillating", "dead_units",
                             "saturated_units", "vanishing_gradients", "loss_stalled", "overfitting", "forgetting"),
    "overfitting": ("forgetting",),
}
GROUP_SCOPED = ("not_in_optimizer", "frozen_parameters", "lr_zero")   # they explain their own group only
# telemetry.py's alert codes, as the analyzer's code for the same problem
ALERT_CODES = {"grad_explosion": "exploding_gradients", "grad_spike": "exploding_gradients"}


def _as_analyzer_code(f: Finding) -> str:
    return ALERT_CODES.get(f.code, f.code) if f.source == "telemetry" else f.code


def _onset(f: Finding) -> int:
    return min(f.steps) if f.steps else 0


def _rank_key(f: Finding):
    """Loud findings first; then by stage (telemetry's own alerts after the analyzer's findings), blow-ups
    by when they began, and by the order within the stage."""
    stage = next((i for i, codes in enumerate(STAGES) if f.code in codes), len(STAGES))
    stage = len(STAGES) + 1 if f.source == "telemetry" else stage
    within = STAGES[stage].index(f.code) if stage < len(STAGES) else 0
    return (f.severity == "info", stage, _onset(f) if f.code in BLOWUPS else 0, within)


def _explains(cause: Finding, f: Finding, tolerance: float = 0) -> bool:
    code = _as_analyzer_code(f)
    if code == "holdout_below_chance" and cause.code not in BLOWUPS:
        code = "holdout_at_chance"   # what leaves a holdout at chance may leave it under it; a blow-up does not
    if code not in CONSEQUENCES.get(cause.code, ()):
        return False
    if cause.explains_only is not None and code not in cause.explains_only:
        return False
    if cause.code in BLOWUPS and _onset(f) < _onset(cause) - tolerance:
        return False   # an effect does not come before its cause (seen at the collections' resolution)
    if cause.code == "lora_not_learning" and code == "frozen_group":
        return "lora" in (f.group or "").lower()
    if cause.code == "lr_zero" and code == "not_learning":
        return cause.group is None
    if cause.code == "unscaled_inputs" and code == "class_imbalance":
        return f.explains_only == ()   # only its harm to the rare classes, not label shares the sampler made
    return not (cause.code in GROUP_SCOPED and code == "frozen_group" and f.group != cause.group)


def rank_findings(findings: list, interval: float = 0) -> list:
    """The findings with each root cause first and what it explains folded into its `consequences`
    (directly or through one of them); a cause takes the highest severity among its consequences, so that
    --check still fails where one of them is critical. Only warnings and criticals explain others.
    `interval`: the steps between two collections, the resolution of every onset."""
    top = []
    for f in sorted(findings, key=_rank_key):
        cause = next((c for c in top if c.severity != "info" and any(
            _explains(x, f, interval) for x in [c] + c.consequences)), None)
        if cause is None:
            top.append(f)
            continue
        cause.consequences.append(f)
        if SEVERITIES.index(f.severity) > SEVERITIES.index(cause.severity):
            cause.severity = f.severity
    return top


def every_finding(findings: list) -> list:
    """The findings with, after each, the ones it explains (depth first): one flat list."""
    return [g for f in findings for g in [f] + every_finding(f.consequences)]


def diagnose(run: Run) -> list:
    """All findings for a run, root causes first, each with the findings it explains under it."""
    findings = []
    with gc_paused():
        for check in CHECKS:
            try:
                found = check(run)
            except Exception as exc:
                _notice(run, f"{CHECK_FAILED} {check.__name__} ({type(exc).__name__}: {_first_line(exc)}); "
                             "its findings are left out")
                continue
            for f in found:
                if f.source == "telemetry" and _fold_alert(findings, f):
                    continue
                if f.source == "telemetry" and (f.code == "grad_spike" or f.code == "grad_explosion"
                                                 and len(f.steps) == 1):
                    # Raised live, from a window of the run; seen whole, no gradient blow-up follows it (an
                    # explosion raised once: a collection's wobble on a plateau, gone at the next)
                    f.severity = "info"
                    f.message += " (over the whole run, no gradient blow-up: a lone spike)"
                findings.append(f)
    gaps = np.diff(steps(run))
    return rank_findings(findings, float(np.median(gaps[gaps > 0])) if (gaps > 0).any() else 0)


def _fold_alert(findings: list, alert: Finding) -> bool:
    """Fold an alert telemetry raised into the analyzer's finding on the same problem, if there is one
    (a group frozen because its LR is 0 is the lr_zero finding's business)."""
    code = _as_analyzer_code(alert)
    same = ("frozen_group", "lr_zero", "frozen_parameters") if code == "frozen_group" else (code,)
    twin = next((f for f in findings if f.code in same and f.source == "analyzer"
                 and (alert.group is None or f.group in (None, alert.group))), None)
    if twin is None:
        return False
    twin.message += f" [telemetry alert {alert.code} at step {alert.steps[0]}]"
    if SEVERITIES.index(alert.severity) > SEVERITIES.index(twin.severity):
        twin.severity = alert.severity
    return True


def summarize(run: Run, findings: list = None) -> dict:
    """The key numbers of a run (used for the terminal summary, JSON and the comparison table)."""
    st = steps(run)
    recs = run.records
    s = {"run": run.name, "path": str(run.path), "records": len(recs)}
    if not recs:
        return s
    s["first_step"], s["last_step"] = int(st[0]), int(st[-1])
    epochs = _finite(column(run, "epoch"))
    s["epochs"] = int(epochs.max()) + 1 if len(epochs) else None
    s["duration_s"] = _duration_s(run)
    s["restarts"] = _restarts(run)
    s["groups"] = _groups(run, "gradient_norm") or _groups(run, "learning_rates")
    s["trainable_parameters"] = _get(run.meta, ["parameters", "trainable"])
    loss = column(run, "loss")
    s["loss_first"], s["loss_last"] = _edge_median(loss, "first", 0.1), _edge_median(loss, "last", 0.1)
    key = train_accuracy_key(run)
    if key:
        s["train_acc_last"] = _edge_median(column(run, key), "last", 0.1)
    h = holdout_data(run)
    if h:
        s.update(_holdout_summary(h))
    _, g, _ = _grad_series(run)
    s["grad_norm_median"] = float(np.median(g)) if g is not None and len(g) else None
    wd = _finite(column(run, "weight_delta.overall"))
    s["weight_delta_median"] = float(np.median(wd)) if len(wd) else None
    lr = _finite(column(run, "learning_rates.overall"))
    s["lr_last"] = float(lr[-1]) if len(lr) else None
    s["group_rates"] = group_rates(run)
    ms = _finite(column(run, "telemetry_ms"))
    s["telemetry_ms_median"] = float(np.median(ms)) if len(ms) else None
    eps = _finite(column(run, "system.examples_per_s"))
    if len(eps):
        s["examples_per_s"] = float(np.median(eps))
    for k, v in list(s.items()):
        if isinstance(v, float) and not math.isfinite(v):
            s[k] = None
    if findings is not None:
        s["findings"] = {sev: sum(f.severity == sev for f in findings) for sev in SEVERITIES}
    return s


def group_rates(run: Run) -> list:
    """Per parameter group (two or more): its last learning rate and its median update ratio ||dW||/||W||
    where it had a gradient, each also as a multiple of the smallest group's, so that a differential learning rate shows whether it
    took effect (is the head really moving at 10x?). Groups outside the optimizer are left out."""
    groups = [g for g in _groups(run, "learning_rates") if not _outside_optimizer(run, g)]
    if len(groups) < 2:
        return []
    rows = []
    for g in groups:
        lr, ur = _finite(column(run, ("learning_rates", g))), column(run, ("update_ratio", g))[1:]
        # Over the collections where the group had a gradient: a head of a multi-task loop, trained on every
        # other batch, is still at the other steps, and its median would read 0.
        grad = column(run, ("gradient_norm", g))[1:]
        ur = _finite(ur[grad > 0] if (grad > 0).any() else ur)
        rows.append({"group": g, "lr": float(lr[-1]) if len(lr) else None,
                     "update_ratio": float(np.median(ur)) if len(ur) else None})
    for key in ("lr", "update_ratio"):
        base = min((r[key] for r in rows if r[key]), default=None)   # the smallest that is not 0
        for r in rows:
            r[f"{key}_x"] = r[key] / base if base and r[key] is not None else None
    return rows


def _group_rates_text(rows: list) -> str:
    return "  learning rate per group (x the smallest), and the update ratio it gave: " + " | ".join(
        f"{r['group']} {_times(r['lr'], r['lr_x'])}" + (f", {_times(r['update_ratio'], r['update_ratio_x'])}"
                                                        if r["update_ratio"] is not None else "") for r in rows)


def _times(value, times) -> str:
    return _fmt(value) + (f" ({times:.3g}x)" if times else "")


def _holdout_summary(h: Holdout) -> dict:
    acc, loss, mae = _finite(h.accuracy), _finite(h.loss), _finite(h.mae)
    s = {"holdout_examples": int(h.n or 0),
         "holdout_acc_first": float(acc[0]) if len(acc) else None,
         "holdout_acc_last": float(acc[-1]) if len(acc) else None,
         "holdout_acc_best": float(np.max(acc)) if len(acc) else None,
         # the last evaluation's, not the last finite one: a run that ended in NaN has no loss to show
         "holdout_loss_last": float(h.loss[-1]) if len(h.loss) and math.isfinite(h.loss[-1]) else None,
         "holdout_loss_best": float(np.min(loss)) if len(loss) else None}
    if len(mae):   # regression holdouts
        s["holdout_mae_last"], s["holdout_mae_best"] = float(mae[-1]), float(np.min(mae))
    return s


def _time(rec: dict):
    t = rec.get("timestamp")
    try:
        return datetime.fromisoformat(t) if isinstance(t, str) else None
    except ValueError:
        return None


def _duration_s(run: Run):
    """Seconds of training: each segment's first-to-last record time, summed, so the time between a stop
    and the resume after it does not count. None when a segment's ends have no readable timestamp."""
    total = 0.0
    for part in _pieces(segment_ids(run)):
        t0, t1 = _time(run.records[part[0]]), _time(run.records[part[-1]])
        try:
            total += (t1 - t0).total_seconds()
        except TypeError:   # a timestamp missing, or one with a time zone and one without
            return None
    return round(total, 1)


def _restarts(run: Run) -> list:
    """Each restart: the step it began at, its index into run.json's starts (None when the step went back
    without a marker) and that start's time."""
    starts = run.meta.get("starts") or []
    return [{"step": r["step"], "start": r["start"],
             "time": starts[r["start"]] if r["start"] is not None and r["start"] < len(starts) else None}
            for r in run.restarts]


# ---- Plots ------------------------------------------------------------------------------------------
# One function per PNG. Each returns None when written, or a one-line reason when its data is absent,
# so a missing section never produces an empty chart.

def _pyplot():
    import matplotlib
    matplotlib.use("Agg")   # files only; never needs a display
    import matplotlib.pyplot as plt
    return plt


LINESTYLES = ["-", "--", ":", "-."]


def _label(runs, run, what):
    return _plain(what if len(runs) == 1 else f"{run.name}: {what}")


def _plain(text: str) -> str:
    """Text from a run (run, group, class, layer, metric names) as matplotlib shows it verbatim: a `$` would
    start math text (a name with one or three fails to draw), and the font renderer rejects a lone
    surrogate (from a damaged group name)."""
    return _escaped(text).replace("$", r"\$")


def _escaped(text: str, encoding: str = "utf-8") -> str:
    """text with what `encoding` cannot hold (lone surrogates) written as backslash escapes."""
    return text.encode(encoding, "backslashreplace").decode(encoding)


def _auto_log(ax, arrays, axis="y"):
    vals = np.concatenate([_finite(np.asarray(a, dtype=float)) for a in arrays] or [np.array([])])
    vals = vals[vals > 0] if len(vals) else vals
    all_pos = len(vals) and all(np.all(_finite(np.asarray(a, dtype=float)) > 0) for a in arrays)
    if all_pos and vals.max() / vals.min() > 30:
        (ax.set_yscale if axis == "y" else ax.set_xscale)("log")


def _floor_span(ax, arrays, share=0.1):
    """Give the y axis a span of at least `share` of the values' size: an RSS that moves by 1 MB in 300 MB
    reads as flat, not as noise blown up to the panel's height. Non-negative series keep 0 as their floor."""
    vals = np.concatenate([_finite(np.asarray(a, dtype=float)) for a in arrays] or [np.array([])])
    if not len(vals):
        return
    lo, hi = float(vals.min()), float(vals.max())
    need = share * max(abs(lo), abs(hi))
    if need > 0 and hi - lo < need:
        bottom = (lo + hi - need) / 2
        bottom = max(bottom, 0.0) if lo >= 0 else bottom
        ax.set_ylim(bottom - 0.05 * need, bottom + need * 1.05)


def _save(fig, path, title):
    fig.suptitle(title)
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=100)   # the same data draws the same bytes: unchanged files stay as they are
    _pyplot().close(fig)
    write_if_changed(Path(path), png.getvalue())


def write_if_changed(path: Path, data: bytes) -> bool:
    """Write `data` unless `path` holds exactly that already (a watched run's plots are not rewritten for
    nothing), through a temporary file so that a browser never reads half of it. True when written.

    A run directory may come from someone else, with a link or a FIFO planted in its analysis folder:
    the old file is read only when it is a regular file, the side file is always a new one (never a link's
    target), and the replace swaps the name itself, so nothing outside the folder is written or waited on."""
    if _regular_file_bytes(path) == data:
        return False
    tmp = path.with_name(path.name + ".tmp")
    _remove_entry(tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return True


def _regular_file_bytes(path: Path):
    """The bytes of `path` when it is a regular file, else None. Opened without following a link and
    without blocking (a FIFO opened for reading waits for a writer), and checked once open."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read()
    except OSError:
        return None
    finally:
        os.close(fd)


def _remove_entry(path: Path) -> None:
    """Remove whatever stands at `path` (a file, a link itself, a FIFO, a directory tree); absent is fine."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def _finish(fig, ax_list, path, title):
    for ax in ax_list:
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, loc="best")
    _save(fig, path, title)


def _finish_steps(fig, ax, path, title, ylabel, unit=False):
    """Finish a one-panel chart over steps; unit=True holds the y axis at 0..1 (shares, accuracies)."""
    if unit:
        ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    _finish(fig, [ax], path, title)


MARKERS = "osD^v<>ph*"


def _group_note(run, group) -> str:
    """' (empty: ...)' for an optimizer group without trainable tensors (run.json groups, tensors 0)."""
    info = (run.meta.get("groups") or {}).get(group)
    if not isinstance(info, dict) or info.get("tensors") != 0:
        return ""
    frozen = info.get("frozen_tensors")
    if isinstance(frozen, int) and frozen:
        return f" (empty: {frozen} frozen tensor{'s' if frozen != 1 else ''})"
    return " (empty: no tensors)"


def _group_series(runs, section):
    """(run index, group index, run, group, steps, values) of every group with a finite value; overall last,
    so that it is drawn on top of the group it equals (the learning rate's overall is the largest group's)."""
    series = []
    for ri, run in enumerate(runs):
        keys = _groups(run, section) + (["overall"] if has_values(run, (section, "overall")) else [])
        for gi, g in enumerate(keys):
            y = column(run, (section, g))
            ok = np.isfinite(y)
            if ok.any():
                series.append((ri, gi, run, g, steps(run)[ok], y[ok]))
    return series


def _group_lines(runs, path, section, title, ylabel, guide=None, change=False):
    """change=True: the section is a change since the previous collection, so the first has no value."""
    plt = _pyplot()
    series = _group_series(runs, section)
    if not series:
        counts = [int(present(run, section).sum()) for run in runs]
        if change and max(counts) == 1:   # switched on, but one collection has no change to show
            return "needs two collections: it is the change between them"
        return f"no {section} values in any record"
    fig, ax = plt.subplots(figsize=(10, 4.5))
    groups_of = {ri: sum(g != "overall" for r, _, _, g, *_ in series if r == ri) for ri in range(len(runs))}
    for ri, gi, run, g, x, y in series:
        if g == "overall":   # dashed and on top: a group with the same values still shows between the dashes
            ax.plot(x, y, linestyle=(0, (4, 3)) if len(runs) == 1 else LINESTYLES[ri % 4], color="black", lw=1.4,
                    zorder=3, label=_label(runs, run, "overall"))
            continue
        # Hollow markers of their own shape, spread along x: groups with equal values all stay visible.
        every = max(groups_of[ri], len(x) // 15)   # at least one step per group: each gets its own offset
        ax.plot(x, y, LINESTYLES[ri % 4], color=f"C{gi % 10}", lw=1.1, alpha=0.9,
                marker=MARKERS[gi % len(MARKERS)], mfc="none", ms=5,
                markevery=(gi * every // max(groups_of[ri], 1), every), label=_label(runs, run, g + _group_note(run, g)))
    _auto_log(ax, [y for *_, y in series])
    if guide is not None:
        ax.axhline(guide[0], color="grey", ls="--", lw=1, label=guide[1])
    _finish_steps(fig, ax, path, title, ylabel)
    return None


def plot_gradient_norm(runs, path):
    return _group_lines(runs, path, "gradient_norm", "Gradient norm per group", "gradient L2 norm")


def plot_weight_delta(runs, path):
    return _group_lines(runs, path, "weight_delta", "Weight change between collections per group",
                        "weight delta (L2)", change=True)


def plot_learning_rate(runs, path):
    return _group_lines(runs, path, "learning_rates", "Learning rate per group", "learning rate")


def plot_update_ratio(runs, path):
    return _group_lines(runs, path, "update_ratio", "Update ratio ||dW|| / ||W|| per group", "update ratio",
                        guide=(1e-3, "1e-3 (typical healthy)"), change=True)


def plot_loss(runs, path):
    plt = _pyplot()
    data = []
    for ri, run in enumerate(runs):
        y = column(run, "loss")
        h = holdout_data(run)
        data.append((ri, run, y, h))
    if not any(np.isfinite(y).any() or (h and np.isfinite(h.loss).any()) for _, _, y, h in data):
        return "no train loss and no holdout loss in any record"
    fig, ax = plt.subplots(figsize=(10, 4.5))
    arrays = []
    for ri, run, y, h in data:
        ok = np.isfinite(y)
        if ok.any():
            x, v = steps(run)[ok], y[ok]
            ax.plot(x, v, LINESTYLES[ri % 4], color="C0" if len(runs) == 1 else f"C{ri}", lw=0.7, alpha=0.45,
                    label=_label(runs, run, "train loss (per batch)"))
            rolled = _rolling(v, np.median)
            if rolled:
                off, sm, w = rolled
                ax.plot(x[off: off + len(sm)], sm, LINESTYLES[ri % 4],
                        color="C0" if len(runs) == 1 else f"C{ri}", lw=1.8,
                        label=_label(runs, run, f"train loss (rolling median of {w})"))
            arrays.append(v)
        if h and np.isfinite(h.loss).any():
            ok = np.isfinite(h.loss)
            ax.plot(h.steps[ok], h.loss[ok], LINESTYLES[ri % 4], color="C3" if len(runs) == 1 else f"C{ri}",
                    marker="o", ms=3, lw=1.5, label=_label(runs, run, "holdout loss"))
            arrays.append(h.loss[ok])
    _auto_log(ax, arrays)
    _finish_steps(fig, ax, path, "Train loss vs holdout loss", "loss")
    return None


def plot_accuracy(runs, path):
    plt = _pyplot()
    if not any((h := holdout_data(r)) and np.isfinite(h.accuracy).any() for r in runs) \
            and not any(train_accuracy_key(r) for r in runs):
        if any((h := holdout_data(r)) and h.kind == "regression" for r in runs):
            return "the holdout is regression: no accuracy to draw (its mean squared error is in loss.png)"
        return "no holdout accuracy and no train accuracy scalar in any record"
    fig, ax = plt.subplots(figsize=(10, 4.5))
    chance_drawn = False
    for ri, run in enumerate(runs):
        h = holdout_data(run)
        color = f"C{ri}" if len(runs) > 1 else "C3"
        if h and np.isfinite(h.accuracy).any():
            ok = np.isfinite(h.accuracy)
            ax.plot(h.steps[ok], h.accuracy[ok], LINESTYLES[ri % 4], color=color, marker="o", ms=3,
                    label=_label(runs, run, "holdout accuracy"))
            if h.kind == "classification" and h.num_classes and not chance_drawn:
                p0, n = 1.0 / h.num_classes, int(h.n or 50)
                band = 2 * _sigma(p0, n)
                ax.axhline(p0, color="grey", ls="--", lw=1, label=f"chance 1/{h.num_classes}")
                ax.axhspan(p0 - band, p0 + band, color="grey", alpha=0.12, label=f"chance +/- 2 sigma (n={n})")
                chance_drawn = True
        key = train_accuracy_key(run)
        if key:
            y = column(run, key)
            ok = np.isfinite(y)
            ax.plot(steps(run)[ok], y[ok], LINESTYLES[ri % 4], color=f"C{ri}" if len(runs) > 1 else "C0",
                    lw=0.8, alpha=0.6, label=_label(runs, run, f"train accuracy ({key})"))
    _finish_steps(fig, ax, path, "Holdout accuracy (and train accuracy)", "accuracy", unit=True)
    return None


HEATMAP_CLASSES = 5   # above this many classes, batch shares are a heatmap: ten lines are a tangle


def _rolling(y: np.ndarray, fn):
    """(offset, rolling fn over an odd window of about 1/20 of the series, window) or None below 9 points."""
    if len(y) < 9:
        return None
    w = max(3, min(51, len(y) // 20 * 2 + 1))
    return w // 2, fn(np.lib.stride_tricks.sliding_window_view(y, w), axis=1), w


def _balance_lines(ax, runs, ri, run, bc):
    names, m, sizes, st = bc
    shares = m / np.maximum(sizes[:, None], 1)
    for ci, c in enumerate(names):
        y = shares[:, ci]
        rolled = _rolling(y, np.mean)
        ax.plot(st, y, LINESTYLES[ri % 4], color=f"C{ci}", lw=0.6, alpha=0.35 if rolled else 1.0,
                label=None if rolled else _label(runs, run, f"class {c}"))
        if rolled:
            off, sm, w = rolled
            ax.plot(st[off: off + len(sm)], sm, LINESTYLES[ri % 4], color=f"C{ci}", lw=1.8,
                    label=_label(runs, run, f"class {c} (rolling mean of {w})"))
    if ri == 0:
        ax.axhline(1.0 / len(names), color="grey", ls="--", lw=1, label=f"balanced 1/{len(names)}")


def _balance_heatmap(fig, ax, runs, run, bc):
    from matplotlib.colors import TwoSlopeNorm
    names, m, sizes, st = bc
    shares = (m / np.maximum(sizes[:, None], 1)).T
    cols = _heat_columns(shares)
    fair = 1.0 / len(names)
    # White is a fair share; red more, blue less: an over-represented class stands out whatever the count.
    norm = TwoSlopeNorm(vcenter=fair, vmin=0.0, vmax=max(float(shares.max()), fair * 1.001))
    im = ax.imshow(shares[:, cols], aspect="auto", interpolation="nearest", cmap="RdBu_r", norm=norm,
                   extent=(*_span(st[cols]), len(names) - 0.5, -0.5))
    fig.colorbar(im, ax=ax, label=f"share of batch (white: 1/{len(names)})")
    if len(names) <= 40:
        ax.set_yticks(range(len(names)))
        ax.set_yticklabels([_plain(n[:20]) for n in names], fontsize=7)
    ax.set_ylabel("class")
    ax.set_title(_label(runs, run, f"{len(names)} classes"), fontsize=10)


def _lm_balance_lines(ax, runs, ri, run):
    for y, what, ci in ((column(run, "batch_stats.label_share"), "label share (tokens with labels)", 0),
                        (column(run, "batch_stats.padding_share"), "padding share", 1)):
        ok = np.isfinite(y)
        if ok.any():
            ax.plot(steps(run)[ok], y[ok], LINESTYLES[ri % 4], color=f"C{ci}", label=_label(runs, run, what))


def _balance_panel(ax, runs, ri, run, bc):
    if bc:
        _balance_lines(ax, runs, ri, run, bc)
    else:   # a language model's batches: supervised and padding shares of the tokens
        _lm_balance_lines(ax, runs, ri, run)


def plot_batch_balance(runs, path):
    plt = _pyplot()
    items = [(run, _batch_counts(run)) for run in runs]
    lm = [has_values(run, "batch_stats.label_share") or has_values(run, "batch_stats.padding_share") for run in runs]
    if not any(bc for _, bc in items) and not any(lm):
        return "no batch_stats in any record"
    if not any(bc and len(bc[0]) > HEATMAP_CLASSES for _, bc in items):   # few classes: lines on one panel
        fig, ax = plt.subplots(figsize=(10, 4.5))
        for ri, (run, bc) in enumerate(items):
            _balance_panel(ax, runs, ri, run, bc)
        _finish_steps(fig, ax, path, "Batch balance over time", "share of batch", unit=True)
        return None
    items = [(ri, run, bc) for ri, (run, bc) in enumerate(items) if bc or lm[ri]][:4]
    fig, axes = plt.subplots(len(items), 1, figsize=(10, 1.5 + 3.5 * len(items)), squeeze=False)
    for ax, (ri, run, bc) in zip(axes[:, 0], items):
        if bc and len(bc[0]) > HEATMAP_CLASSES:
            _balance_heatmap(fig, ax, runs, run, bc)
        else:
            _balance_panel(ax, runs, ri, run, bc)
            ax.set_ylim(-0.02, 1.02)
            ax.legend(fontsize=8, loc="best")
        ax.set_xlabel("step")
    _save(fig, path, "Batch balance over time")
    return None


def _span(st) -> tuple:
    """The x extent of a heatmap over steps `st`; one step is padded by half a step either side (equal
    limits make matplotlib warn and pick its own)."""
    lo, hi = float(st[0]), float(st[-1])
    return (lo - 0.5, hi + 0.5) if lo == hi else (lo, hi)


def _heat_columns(matrix, max_cols=1500):
    # Tens of thousands of collections do not fit in pixels; sample evenly so the image stays light.
    if matrix.shape[1] <= max_cols:
        return np.arange(matrix.shape[1])
    return np.linspace(0, matrix.shape[1] - 1, max_cols).astype(int)


def plot_holdout_heatmap(runs, path):
    plt = _pyplot()
    from matplotlib.colors import ListedColormap
    panels = [(run, h) for run in runs if (h := holdout_data(run)) and h.correct is not None
              and h.correct.shape[1] >= 2]
    if not panels:
        if any((h := holdout_data(run)) and h.correct is not None for run in runs):
            return "needs two collections with per-example holdout predictions"
        return "no per-example holdout predictions (holdout_logits labels/predictions) in at least 2 records"
    panels = panels[:4]
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 1.5 + 3.5 * len(panels)), squeeze=False)
    for ax, (run, h) in zip(axes[:, 0], panels):
        mat = h.correct
        cols = _heat_columns(mat)
        st = h.matrix_steps[cols]
        if h.kind == "classification":
            c = mat.astype(bool)
            ever = c.any(axis=1)
            flips = (c[:, :-1] & ~c[:, 1:]).any(axis=1)
            cat = np.where(~ever, 0, np.where(flips, 1, 2))
            order = np.lexsort((-c.mean(axis=1), cat))
            img = c[order][:, cols].astype(float)
            ax.imshow(img, aspect="auto", interpolation="nearest", cmap=ListedColormap(["#d7301f", "#1a9850"]),
                      vmin=0, vmax=1, extent=(*_span(st), len(order) - 0.5, -0.5))
            ticks, labels, start = [], [], 0
            for k, name in enumerate(("never learned", "flip (forgotten at least once)", "learned")):
                count = int((cat == k).sum())
                if count:
                    ticks.append(start + (count - 1) / 2)
                    labels.append(f"{name} ({count})")
                    if start:
                        ax.axhline(start - 0.5, color="white", lw=2)
                    start += count
            ax.set_yticks(ticks)
            ax.set_yticklabels(labels, fontsize=8)
            ax.set_title(_label(runs, run, "per-example holdout correctness (green = right, red = wrong)"),
                         fontsize=10)
        else:
            what = "absolute error" if h.kind == "regression" else "token accuracy"
            top = float(np.nanpercentile(mat, 99)) if h.kind == "regression" and np.isfinite(mat).any() else 1.0
            order = np.argsort(mat[:, -1])
            im = ax.imshow(mat[order][:, cols], aspect="auto", interpolation="nearest", cmap="viridis",
                           vmin=0, vmax=top or 1.0, extent=(*_span(st), len(order) - 0.5, -0.5))
            fig.colorbar(im, ax=ax, label=what)
            ax.set_ylabel(f"holdout example (sorted by final {what.split()[-1]})")
            ax.set_title(_label(runs, run, f"per-example holdout {what}"), fontsize=10)
        ax.set_xlabel("step")
    _save(fig, path, "Holdout examples over time")
    return None


def plot_lora(runs, path):
    plt = _pyplot()
    panels = []
    for key, title, log in (("lora.adapter_norm.overall", "adapter norm ||BA||*scale", True),
                            ("lora.adapter_delta.overall", "adapter change per collection", True),
                            ("lora.grad_norm_A|lora.grad_norm_B", "LoRA gradient norms (A, B)", True),
                            ("lora.b_zero_fraction", "share of LoRA B still exactly 0", False)):
        if any(has_values(r, k) for r in runs for k in key.split("|")):
            panels.append((key, title, log))
    if not panels:
        return "no lora section in any record"
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 2.8 * len(panels)), squeeze=False)
    for ax, (key, title, log) in zip(axes[:, 0], panels):
        arrays = []
        for ri, run in enumerate(runs):
            for ki, k in enumerate(key.split("|")):
                y = column(run, k)
                ok = np.isfinite(y)
                if ok.any():
                    ax.plot(steps(run)[ok], y[ok], LINESTYLES[ri % 4], color=f"C{ki}",
                            label=_label(runs, run, k.split(".")[-1]))
                    arrays.append(y[ok])
        if log:
            _auto_log(ax, arrays)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel("gradient norm" if "|" in key else key.split(".")[1])
    _finish(fig, list(axes[:, 0]), path, "LoRA adapters")
    return None


def plot_layer_heatmap(runs, path):
    plt = _pyplot()
    from matplotlib.colors import LogNorm
    panels = []
    for run in runs:
        layers = section_keys(run, "layer_stats", skip_overall=False)
        rows = [column(run, ("layer_stats", k, "grad_norm")) for k in layers[:80]]
        if rows and any(np.isfinite(r).any() for r in rows):
            panels.append((run, layers[:80], np.vstack(rows)))
    if not panels:
        return "no layer_stats grad_norm in any record"
    panels = panels[:4]
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 2 + 0.18 * max(len(p[1]) for p in panels) * len(panels)),
                             squeeze=False)
    for ax, (run, layers, mat) in zip(axes[:, 0], panels):
        cols = _heat_columns(mat)
        st = steps(run)[cols]
        img = np.where(np.isfinite(mat) & (mat > 0), mat, np.nan)[:, cols]
        pos = _finite(img)
        norm = LogNorm(vmin=pos.min(), vmax=max(pos.max(), pos.min() * 1.0001)) if len(pos) else None
        cmap = plt.get_cmap("magma").with_extremes(bad="#d9d9d9")   # zero/absent gradients show grey
        im = ax.imshow(img, aspect="auto", interpolation="nearest", cmap=cmap, norm=norm,
                       extent=(*_span(st), len(layers) - 0.5, -0.5))
        fig.colorbar(im, ax=ax, label="gradient norm (log)")
        if len(layers) <= 60:
            ax.set_yticks(range(len(layers)))
            ax.set_yticklabels([_plain(k if len(k) <= 40 else "..." + k[-37:]) for k in layers], fontsize=6)
        ax.set_ylabel("layer")
        ax.set_xlabel("step")
        ax.set_title(_label(runs, run, "per-layer gradient norm (grey = zero or absent)"), fontsize=10)
    _save(fig, path, "Per-layer gradient norm")
    return None


def _threshold_order(key):
    try:
        return (0, float(key))
    except ValueError:
        return (1, 0.0)


def plot_sparsity(runs, path):
    plt = _pyplot()
    series = []
    for ri, run in enumerate(runs):
        for sub, ls in (("sparsity", "-"), ("sparsity_rel", "--")):
            for ti, t in enumerate(sorted(section_keys(run, f"param_change.{sub}", skip_overall=False),
                                          key=_threshold_order)):
                y = column(run, ("param_change", sub, t))
                ok = np.isfinite(y)
                if ok.any():
                    series.append((ri, run, f"{'|dW| < ' if sub == 'sparsity' else '|dW|/|W| < '}{t}",
                                   ls, ti, steps(run)[ok], y[ok]))
    if not series:
        return "no param_change.sparsity in any record"
    fig, ax = plt.subplots(figsize=(10, 4.5))
    for ri, run, what, ls, ti, x, y in series:
        ax.plot(x, y, ls if len(runs) == 1 else LINESTYLES[ri % 4], color=f"C{ti % 10}",
                label=_label(runs, run, what))
    _finish_steps(fig, ax, path, "Parameter-change sparsity", "share of weights that (almost) did not change",
                  unit=True)
    return None


def plot_sparse_quality(runs, path):
    plt = _pyplot()
    per_run = []
    for run in runs:
        last = next((r["sparse_quality"] for r in reversed(run.records) if isinstance(r.get("sparse_quality"), dict)),
                    None)
        if last:
            pts = []
            for t, v in last.items():
                try:
                    pts.append((float(t), v))
                except ValueError:
                    continue
            if pts:
                per_run.append((run, sorted(pts, key=lambda p: p[0])))
    if not per_run:
        return "no sparse_quality in any record"
    metrics = [m for m in ("kl", "cosine", "mse", "top1_agree")
               if any(isinstance(v.get(m), (int, float)) for _, pts in per_run for _, v in pts if isinstance(v, dict))]
    if not metrics:
        return "sparse_quality holds none of kl/cosine/mse/top1_agree"
    fig, axes = plt.subplots(1, len(metrics), figsize=(4 * len(metrics), 4), squeeze=False)
    for ax, m in zip(axes[0], metrics):
        for ri, (run, pts) in enumerate(per_run):
            x = [t for t, v in pts if isinstance(v, dict)]
            y = [_num(v.get(m)) for t, v in pts if isinstance(v, dict)]
            yr = [_num((v.get("random") or {}).get(m)) for t, v in pts if isinstance(v, dict)]
            ax.plot(x, y, "-o", color=f"C{ri}", ms=3, label=_label(runs, run, "kept top changes"))
            if np.isfinite(yr).any():
                ax.plot(x, yr, "--x", color=f"C{ri}", ms=3, alpha=0.7, label=_label(runs, run, "random baseline"))
        if all(t > 0 for _, pts in per_run for t, _ in pts):
            ax.set_xscale("log")
        ax.set_xlabel("threshold")
        ax.set_ylabel(m)
        ax.set_title(m, fontsize=10)
    _finish(fig, list(axes[0]), path, "Sparse-update quality vs random baseline (last collection)")
    return None


def plot_system(runs, path):
    plt = _pyplot()
    keys = []
    for run in runs:
        for k in section_keys(run, "system", skip_overall=False):
            if k not in keys and has_values(run, ("system", k)):
                keys.append(k)
    if not keys:
        return "no system metrics in any record"
    keys = keys[:9]
    ncols = 3 if len(keys) > 4 else min(2, len(keys))
    nrows = int(math.ceil(len(keys) / ncols))
    fig = plt.figure(figsize=(5 * ncols, 3 * nrows))
    axes = []
    for i, k in enumerate(keys):
        ax = fig.add_subplot(nrows, ncols, i + 1)   # only as many axes as metrics: no empty panels
        arrays = []
        for ri, run in enumerate(runs):
            y = column(run, ("system", k))
            ok = np.isfinite(y)
            if ok.any():
                ax.plot(steps(run)[ok], y[ok], LINESTYLES[ri % 4], color=f"C{ri}", label=_label(runs, run, k)
                        if len(runs) > 1 else None)
                arrays.append(y[ok])
        _floor_span(ax, arrays)
        ax.set_title(_plain(k), fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel(_plain(k))
        axes.append(ax)
    _finish(fig, axes, path, "System metrics")
    return None


# Every plot: its file, the function that draws it, what turns its data on when a run has none, and how to
# read it (the report prints that line under the image).
PLOTS = (
    ("loss.png", plot_loss, "loss= in on_batch_end",
     "Faint: the train loss of each collected batch; bold: its rolling median; red dots: the holdout loss. "
     "Holdout loss rising while train loss falls is overfitting."),
    ("accuracy.png", plot_accuracy, "set_holdout_data, or train_acc= in on_batch_end",
     "Holdout accuracy (dots) against chance (dashed) and its 2-sigma noise band (grey); faint: train accuracy. "
     "Holdout inside the band while train accuracy climbs is memorisation."),
    ("gradient_norm.png", plot_gradient_norm, "track_gradients: true",
     "Gradient L2 norm per group; black dashed: overall, their root-sum-square. A group at zero gets no "
     "gradient; steady growth or 10x jumps are explosions, a slide towards zero vanishing gradients."),
    ("weight_delta.png", plot_weight_delta, "track_weight_delta: true",
     "How far each group's weights moved between two collections. A group flat at zero does not train "
     "(learning rate 0, frozen, or outside the optimizer)."),
    ("learning_rate.png", plot_learning_rate, "track_learning_rates: true",
     "Each group's learning rate after the scheduler; black dashed: overall, the largest. Groups with equal "
     "rates overlap: their markers sit at different steps."),
    ("batch_balance.png", plot_batch_balance, "track_batch_stats: true, batch= in on_batch_end",
     f"The share of each class in the collected batches; dashed: a fair share. Above {HEATMAP_CLASSES} classes "
     "a heatmap: white is a fair share, red more, blue less."),
    ("holdout_heatmap.png", plot_holdout_heatmap, "set_holdout_data",
     "One row per holdout example over time, green right and red wrong (language models: token accuracy; "
     "regression: absolute error). Rows that turn red after green were forgotten."),
    ("update_ratio.png", plot_update_ratio, "track_update_ratio: true",
     "||dW|| / ||W|| per group and collection: about 1e-3 (dashed) is typical; far below, the group barely "
     "learns; far above, its steps are too large."),
    ("layer_grad_heatmap.png", plot_layer_heatmap, "track_layer_stats: true",
     "Gradient norm per layer (rows) over time on a log colour scale; grey is zero or absent. Layers that "
     "stay dark get almost no gradient."),
    ("lora.png", plot_lora, "a model with LoRA adapters",
     "LoRA adapters: the norm of s*B*A, its change per collection, the gradient norms of A and B, and the "
     "share of B still exactly 0 (staying at 1: the adapters never learned)."),
    ("param_change_sparsity.png", plot_sparsity, "track_param_change: true",
     "The share of weights whose change since the last collection is under each threshold (solid: "
     "absolute, dashed: relative to |W|)."),
    ("sparse_quality.png", plot_sparse_quality, "track_sparse_quality: true",
     "Holdout outputs with only the changes above each threshold applied, against the full update "
     "(solid), next to a random mask that keeps as many (dashed)."),
    ("system.png", plot_system, "track_system: true",
     "Step time, throughput, memory and telemetry's share of the wall time. Each y axis spans at least 10% "
     "of its values, so a flat series reads flat."),
)
PLOT_HELP = {name: help_line for name, _, _, help_line in PLOTS}


def make_plots(runs, out_dir: Path):
    """Write every plot that has data; returns ([written paths], [(name, why skipped)]). A file whose
    drawing did not change is left untouched."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written, skipped = [], []
    for name, fn, switch, _ in PLOTS:
        path = out_dir / name
        try:
            why = fn(runs, path)
        except OSError:   # the folder cannot be written: told once, by the caller
            _pyplot().close("all")
            raise
        except Exception as exc:   # one broken chart must not cost the others and the report
            why = f"failed: {type(exc).__name__}: {exc}"
            _pyplot().close("all")
        if why is None:
            written.append(path)
        else:
            # Data that is simply absent: name the switch or call that records it.
            skipped.append((name, f"{why}; to draw it: {switch}" if why.startswith("no ") else why))
            _remove_entry(path)   # a stale chart from an earlier analysis would mislead
    return written, skipped


def skipped_line(skipped) -> str:
    """The skipped plots in one line: what would enable each (or why it cannot be drawn)."""
    parts = [f"{name[:-4] if name.endswith('.png') else name} "
             f"({why.split('; to draw it: ', 1)[1] if '; to draw it: ' in why else why})" for name, why in skipped]
    return f"skipped {len(skipped)} plot{'s' if len(skipped) != 1 else ''}: " + ", ".join(parts)


# ---- Report -----------------------------------------------------------------------------------------

COMPARE_ROWS = (
    ("records", "records"), ("last_step", "last step"), ("epochs", "epochs"), ("duration_s", "duration (s)"),
    ("loss_first", "train loss, start"), ("loss_last", "train loss, end"), ("train_acc_last", "train accuracy, end"),
    ("holdout_acc_last", "holdout accuracy, end"), ("holdout_acc_best", "holdout accuracy, best"),
    ("holdout_loss_last", "holdout loss, end"), ("holdout_loss_best", "holdout loss, best"),
    ("grad_norm_median", "gradient norm (median)"), ("weight_delta_median", "weight delta (median)"),
    ("lr_last", "learning rate, end"), ("examples_per_s", "examples/s"),
    ("telemetry_ms_median", "telemetry ms/record"),
)


def comparison_rows(summaries):
    """[(label, [value per run])] for the numbers at least one run has."""
    rows = []
    for key, label in COMPARE_ROWS:
        vals = [s.get(key) for s in summaries]
        if any(v is not None for v in vals):
            rows.append((label, [_fmt(v) for v in vals]))
    rows.append(("findings (crit/warn/info)",
                 [f"{s['findings']['critical']}/{s['findings']['warning']}/{s['findings']['info']}"
                  if "findings" in s else "" for s in summaries]))
    return rows


def format_text(results) -> str:
    """The terminal report: a short summary per run, its findings, and a comparison for several runs."""
    out = []
    for run, findings, summary in results:
        s = summary
        dur = f", {s['duration_s']:.0f}s" if s.get("duration_s") else ""
        out.append(f"Run {run.name} ({run.path}): {s['records']} records"
                   + (f", steps {s['first_step']}-{s['last_step']}, {s['epochs']} epoch(s){dur}" if s["records"] else ""))
        bits = []
        if s.get("loss_first") is not None:
            bits.append(f"train loss {_fmt(s['loss_first'])} -> {_fmt(s['loss_last'])} (medians of the first and "
                        "last 10%)")
        if s.get("train_acc_last") is not None:
            bits.append(f"train acc {s['train_acc_last']:.3f}")
        if s.get("holdout_acc_last") is not None:
            bits.append(f"holdout acc {s['holdout_acc_first']:.3f} -> {s['holdout_acc_last']:.3f} "
                        f"(best {s['holdout_acc_best']:.3f})")
        if s.get("holdout_loss_last") is not None:
            bits.append(f"holdout loss {_fmt(s['holdout_loss_last'])}")
        if s.get("grad_norm_median") is not None:
            bits.append(f"grad norm ~{_fmt(s['grad_norm_median'])}")
        if bits:
            out.append("  " + " | ".join(bits))
        if s.get("group_rates"):
            out.append(_group_rates_text(s["group_rates"]))
        if s.get("restarts"):
            out.append("  restarts: " + ", ".join(
                f"step {r['step']} (start {r['start']}" + (f", {r['time']}" if r["time"] else "") + ")"
                if r["start"] is not None else f"step {r['step']} (the step went back; no restart marker)"
                for r in s["restarts"]))
        for n in run.notices:
            out.append(f"  notice: {n}")
        if not run.records:
            out.append("  No records to judge yet.")
        elif not findings:
            out.append("  No findings: nothing looks wrong.")
        for f in findings:
            out += _finding_lines(f)
        out.append("")
    if len(results) > 1:
        names = [r.name for r, _, _ in results]
        rows = comparison_rows([s for _, _, s in results])
        w0 = max(len(label) for label, _ in rows)
        widths = [max(len(n), *(len(v[i]) for _, v in rows)) for i, n in enumerate(names)]
        out.append("Comparison")
        out.append("  " + " " * w0 + "  " + "  ".join(n.rjust(w) for n, w in zip(names, widths)))
        for label, vals in rows:
            out.append("  " + label.ljust(w0) + "  " + "  ".join(v.rjust(w) for v, w in zip(vals, widths)))
        out.append("")
    return "\n".join(out)


def _finding_lines(f: Finding, indent: str = "  ") -> list:
    """A finding's text lines, with the findings it explains indented under it."""
    lines = [f"{indent}{f.severity.upper():8} {f.code}: {f.message}", f"{indent}         hint: {f.hint}"]
    if f.consequences:
        lines.append(f"{indent}         follows from it:")
        for c in f.consequences:
            lines += _finding_lines(c, indent + "           ")
    return lines


def _public(items) -> dict:
    """A finding as --json shows it: without the fields that only steer the ranking."""
    return {k: v for k, v in items if k != "explains_only"}


def findings_json(results) -> dict:
    def one(run, findings, summary):
        return {"run_dir": str(run.path), "summary": summary,
                "findings": [asdict(f, dict_factory=_public) for f in findings],
                "notices": run.notices}
    if len(results) == 1:
        return one(*results[0])
    return {"runs": [one(*r) for r in results],
            "comparison": [{"metric": label, "values": vals} for label, vals
                           in comparison_rows([s for _, _, s in results])]}


REPORT_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:16px 24px;color:#222}
h1{font-size:22px;margin:4px 0}h2{font-size:18px;border-bottom:1px solid #ddd;padding-bottom:4px;margin-top:24px}
h3{font-size:15px;margin:12px 0 6px}.sub{color:#555;font-size:13px;margin:2px 0 8px}
table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ddd;padding:3px 8px;text-align:right}
th:first-child,td:first-child{text-align:left}th{background:#f4f4f4}
.cols{display:grid;grid-template-columns:repeat(auto-fit,minmax(480px,1fr));gap:8px 32px;align-items:start}
.plots{display:grid;grid-template-columns:repeat(auto-fill,minmax(560px,1fr));gap:20px}
figure{margin:0}img{width:100%;height:auto;border:1px solid #eee}
figcaption{font-size:13px;color:#444;margin-top:4px}figcaption b{color:#222}
.f{margin:6px 0;padding:6px 10px;border-left:6px solid #999;background:#f7f7f7;font-size:14px}
.critical{border-color:#c0392b;background:#fdecea}.warning{border-color:#e67e22;background:#fff4e5}
.info{border-color:#2e86c1;background:#eef6fc}.sev{font-weight:bold;text-transform:uppercase}
.hint{color:#555;font-size:13px;margin-top:3px}.notice{color:#7a5c00;font-size:13px}
.ok{color:#1e8449;font-weight:bold}.noted td{background:#fff4e5}.live{background:#eef6fc;padding:4px 10px}
.cfg{columns:3 240px;font:12px ui-monospace,monospace;margin:4px 0}.cfg div{break-inside:avoid}
details summary{cursor:pointer;font-size:13px;color:#333}
"""


def write_report(results, written, skipped, out_dir: Path, refresh: float = None) -> Path:
    """One self-contained HTML file: images are inlined as base64, nothing is fetched. `refresh` (seconds),
    while --watch runs: the page reloads itself; the last report of a watch has none."""
    e = html.escape
    title = "Training telemetry: " + ", ".join(r.name for r, _, _ in results)
    live = f"<meta http-equiv='refresh' content='{max(1, math.ceil(refresh))}'>" if refresh else ""
    parts = [f"<!doctype html><html><head><meta charset='utf-8'>{live}<title>{e(title)}</title>"
             f"<style>{REPORT_CSS}</style></head><body><h1>{e(title)}</h1>",
             f"<p class='sub'>Generated {datetime.now().isoformat(timespec='seconds')} by analyze_telemetry.py."
             + (f" <span class='live'>Live: reloads every {max(1, math.ceil(refresh))} s while --watch runs.</span>"
                if refresh else "") + "</p>", "<div class='cols'><div>", _report_summary(results)]
    for run, findings, _ in results:
        parts.append(_report_findings(run, findings))
    parts.append("</div><div>")
    parts.extend(_report_run(run) for run, _, _ in results)
    parts.append("</div></div>")
    parts.append(_report_plots(written, skipped))
    parts.append("</body></html>")
    path = out_dir / "report.html"
    write_if_changed(path, "\n".join(parts).encode("utf-8", "backslashreplace"))
    return path


def _report_summary(results) -> str:
    e = html.escape
    rows = comparison_rows([s for _, _, s in results])
    out = ["<h2>Summary</h2><table><tr><th></th>" + "".join(f"<th>{e(r.name)}</th>" for r, _, _ in results) + "</tr>"]
    out += [f"<tr><td>{e(label)}</td>" + "".join(f"<td>{e(v)}</td>" for v in vals) + "</tr>" for label, vals in rows]
    return "".join(out) + "</table>"


def _report_findings(run, findings) -> str:
    e = html.escape
    out = [f"<h2>Findings: {e(run.name)}</h2>"]
    out += [f"<p class='notice'>notice: {e(n)}</p>" for n in run.notices]
    if not findings:
        out.append("<p class='ok'>No findings: nothing looks wrong.</p>")
    for f in every_finding(findings):
        where = ", ".join(str(s) for s in f.steps[:10])
        out.append(f"<div class='f {e(f.severity)}'><span class='sev'>{e(f.severity)}</span> "
                   f"<code>{e(f.code)}</code> {e(f.message)}" + (f" <em>(steps {e(where)})</em>" if where else "")
                   + f"<div class='hint'>Try: {e(f.hint)}</div></div>")
    return "".join(out)


def _dict(value) -> dict:
    return value if isinstance(value, dict) else {}   # run.json is read as found: a field may be damaged


def run_facts(run) -> list:
    """[(label, text)] about a run from its run.json: where, when, what was trained."""
    m = run.meta
    starts = [t for t in m.get("starts") or [] if isinstance(t, str)]
    facts = [("directory", str(run.path))]
    if starts:
        facts.append(("started", starts[0] + (f" (+{len(starts) - 1} restart(s))" if len(starts) > 1 else "")))
    ended = run_end(run)
    facts.append(("ended", ended or "still running, or stopped without close()"))
    params = _dict(m.get("parameters"))
    if isinstance(params.get("total"), int):
        trainable = params.get("trainable")
        facts.append(("parameters", f"{params['total']:,} total, "
                      + (f"{trainable:,} trainable" if isinstance(trainable, int) else "trainable unknown")))
    for key, label in (("optimizer", "optimizer"), ("parallelism", "parallelism"), ("world_size", "world size"),
                       ("torch_version", "torch")):
        if isinstance(m.get(key), (str, int)) and not isinstance(m.get(key), bool):
            facts.append((label, str(m[key])))
    if isinstance(_dict(m.get("holdout")).get("examples"), int):
        facts.append(("holdout", f"{m['holdout']['examples']} examples"))
    return facts


def run_end(run):
    """When the run's last start closed (run.json's ends, aligned with starts), or None while it is open."""
    starts, ends = run.meta.get("starts"), run.meta.get("ends")
    if not isinstance(starts, list) or not starts or not isinstance(ends, list) or len(ends) < len(starts):
        return None
    last = ends[len(starts) - 1]
    return last if isinstance(last, str) else None


def _group_rows(run) -> list:
    """(group, trainable tensors, elements, share of trainable, last lr, note) per group in run.json."""
    groups = dict(_dict(run.meta.get("groups")))
    if _dict(run.meta.get(NOT_IN_OPTIMIZER)):
        groups[NOT_IN_OPTIMIZER] = run.meta[NOT_IN_OPTIMIZER]
    trainable = _get(run.meta, ["parameters", "trainable"])
    rows = []
    for g, info in groups.items():
        info = _dict(info)
        tensors, elements = info.get("tensors"), info.get("elements")
        share = elements / trainable if isinstance(elements, int) and isinstance(trainable, int) and trainable else None
        lr = _finite(column(run, ("learning_rates", g)))
        note = _group_note(run, g).strip(" ()")
        if g == NOT_IN_OPTIMIZER:
            note = "trainable, but in no optimizer group: never updated"
        elif isinstance(info.get("frozen_tensors"), int) and info["frozen_tensors"] and tensors:
            note = f"{info['frozen_tensors']} frozen tensor(s) too"
        rows.append((g, tensors, elements, share, float(lr[-1]) if len(lr) else None, note))
    return rows


def _report_run(run) -> str:
    e = html.escape
    out = [f"<h2>Run: {e(run.name)}</h2><table>"]
    out += [f"<tr><td>{e(k)}</td><td style='text-align:left'>{e(v)}</td></tr>" for k, v in run_facts(run)]
    out.append("</table>")
    rows = _group_rows(run)
    if rows:
        out.append("<h3>Groups</h3><table><tr><th>group</th><th>trainable tensors</th><th>elements</th>"
                   "<th>share</th><th>lr, last</th><th>note</th></tr>")
        for g, tensors, elements, share, lr, note in rows:
            cells = [tensors, f"{elements:,}" if isinstance(elements, int) else elements,
                     f"{share:.1%}" if share is not None else "", _fmt(lr) if lr is not None else "", note]
            out.append(f"<tr class='{'noted' if note else ''}'><td>{e(str(g))}</td>"
                       + "".join(f"<td>{e('' if c is None else str(c))}</td>" for c in cells) + "</tr>")
        out.append("</table>")
    config = _dict(run.meta.get("config"))
    if config:
        items = "".join(f"<div>{e(str(k))}: {e(json.dumps(v, default=str))}</div>" for k, v in config.items())
        out.append(f"<details open><summary>config ({len(config)} keys, from run.json)</summary>"
                   f"<div class='cfg'>{items}</div></details>")
    return "".join(out)


def _report_plots(written, skipped) -> str:
    e = html.escape
    out = ["<h2>Plots</h2><div class='plots'>"]
    for path in written:
        data = base64.b64encode(Path(path).read_bytes()).decode("ascii")
        out.append(f"<figure><img alt='{e(path.stem)}' src='data:image/png;base64,{data}'>"
                   f"<figcaption><b>{e(path.name)}</b>: {e(PLOT_HELP.get(path.name, ''))}</figcaption></figure>")
    out.append("</div>")
    if skipped:
        out.append("<h2>Plots not drawn</h2><ul>" + "".join(f"<li>{e(n)}: {e(w)}</li>" for n, w in skipped) + "</ul>")
    return "".join(out)


def write_csv(runs, path) -> int:
    """One flat row per record (a leading `run` column when several runs go into one file)."""
    all_cols, all_rows = merged_rows(runs)
    columns = (["run"] if len(runs) > 1 else []) + all_cols
    with open(path, "w", newline="", encoding="utf-8", errors="backslashreplace") as f:
        w = csv.writer(f)
        w.writerow(columns)
        for name, row in all_rows:
            vals = [name] if len(runs) > 1 else []
            for c in all_cols:
                v = row.get(c)
                vals.append("" if v is None else repr(v) if isinstance(v, float) else v)
            w.writerow(vals)
    return len(all_rows)


def export_tensorboard(runs, log_dir) -> str:
    """Scalars to TensorBoard event files, if a writer is installed; returns what happened."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except Exception:
        try:
            from tensorboardX import SummaryWriter
        except Exception:
            return "skipped --tensorboard: neither torch.utils.tensorboard (needs the tensorboard package) " \
                   "nor tensorboardX is installed"
    count = 0
    for run in runs:
        writer = SummaryWriter(log_dir=str(Path(log_dir) / run.name) if len(runs) > 1 else str(log_dir))
        for rec in run.records:
            for k, v in flat_record(rec).items():
                if k in ("step", "schema") or not math.isfinite(_num(v)):
                    continue
                writer.add_scalar(k.replace(".", "/"), v, global_step=rec["step"])
                count += 1
        writer.close()
    return f"wrote {count:,} scalars to TensorBoard logs in {log_dir}"


# ---- Command line -----------------------------------------------------------------------------------

def _seconds(positive: bool):
    """An argparse type: a finite number of seconds, above 0 (positive) or at least 0."""
    def parse(text):
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < 0 or (positive and value == 0):
            raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds "
                                             f"{'above 0' if positive else 'of 0 or more'}")
        return value
    return parse


def _parser():
    p = argparse.ArgumentParser(
        prog="analyze-telemetry", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Exit status: 0 ok, 1 with --check when a finding is critical, 2 when a run cannot be read (with "
               "--check: when it holds no readable record) or an output cannot be written.")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directory (or its telemetry.jsonl)")
    p.add_argument("--out", help="where plots and report.html go (default RUN_DIR/analysis/; several runs: "
                                 "FIRST_RUN/analysis/compare-A-vs-B/)")
    p.add_argument("--json", action="store_true", help="print summary and findings as JSON on stdout")
    p.add_argument("--check", action="store_true", help="exit 1 when any finding is critical")
    p.add_argument("--csv", metavar="FILE", help="write one flat row per record to FILE")
    p.add_argument("--plots", action="store_true", help="also write plots with --json/--check/--csv")
    p.add_argument("--no-plots", action="store_true", help="skip plots and report.html")
    p.add_argument("--watch", action="store_true",
                   help="follow the run while it trains (it need not exist yet); ends when the run closes")
    p.add_argument("--interval", type=_seconds(positive=True), default=5.0, metavar="SECONDS",
                   help="--watch poll interval (5)")
    p.add_argument("--redraw", type=_seconds(positive=False), default=30.0, metavar="SECONDS",
                   help="--watch: redraw plots and report at most this often (30)")
    p.add_argument("--max-seconds", type=_seconds(positive=False), metavar="N",
                   help="end --watch by itself after N seconds")
    p.add_argument("--tensorboard", metavar="DIR", help="also export scalars as TensorBoard logs to DIR")
    return p


def _out_dir(args, runs) -> Path:
    if args.out:
        return Path(args.out)
    if len(runs) == 1:
        return runs[0].path / "analysis"
    return runs[0].path / "analysis" / comparison_name(runs)


def comparison_name(runs) -> str:
    """compare-A-vs-B: named after every compared run, so that another comparison never overwrites it."""
    safe = [re.sub(r"[^A-Za-z0-9._-]+", "_", r.name).strip("._") or "run" for r in runs]
    name = "compare-" + "-vs-".join(safe)
    if len(name) > 100:   # many runs: a readable start and a digest of the whole list
        name = name[:90] + "-" + hashlib.sha1(name.encode()).hexdigest()[:8]
    return name


def _unique_names(runs):
    seen = {}
    for run in runs:
        if run.name in seen:
            run.name = f"{run.path.resolve().parent.name}/{run.name}"
        seen[run.name] = run


def plots_unavailable():
    """None when matplotlib imports; else the one line that says how to get the plots."""
    try:
        _pyplot()
    except ImportError:
        return f"plots skipped: matplotlib is not installed ({INSTALL_HINT})"
    return None


def _draw(runs, args, results, refresh=None):
    """Plots and report.html for the results; (out dir, report path, written plots, skipped plots)."""
    out = _out_dir(args, runs)
    try:
        if not args.out:
            _no_link_below(runs[0].path, out)
        if out.exists() and not out.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(out))
        written, skipped = make_plots(runs, out)
        return out, write_report(results, written, skipped, out, refresh), written, skipped
    except OSError as exc:
        raise CannotWrite(f"the plots and report.html to {out}", exc,
                          "" if args.out else "--out DIR writes them elsewhere, --no-plots skips them") from None


def _no_link_below(base: Path, out: Path) -> None:
    """Refuse a symbolic link between the run directory and the default output folder: a run received from
    someone else could point its analysis folder anywhere, and the plots would be written there."""
    p = base
    for part in out.relative_to(base).parts:
        p = p / part
        if p.is_symlink():
            raise OSError(errno.ELOOP, "a symbolic link in the run directory; not written through", str(p))


class CannotWrite(Exception):
    """An output the analyzer cannot write: told in one line, exit status 2."""

    def __init__(self, what: str, exc: OSError, hint: str = ""):
        name = exc.filename2 or exc.filename   # a replace names the file it replaces second
        where = f" ({name})" if name and str(name) not in what else ""
        super().__init__(f"cannot write {what}: {exc.strerror or exc}{where}" + (f"; {hint}" if hint else ""))


def _emit(text: str, file=None, **kwargs) -> None:
    """print, with what the stream cannot encode (a lone surrogate from a damaged record) escaped."""
    file = file or sys.stdout
    print(_escaped(text, getattr(file, "encoding", None) or "utf-8"), file=file, **kwargs)


def _print_where(where, stream):
    out, report, written, skipped = where
    if skipped:
        _emit(skipped_line(skipped), file=stream)
    print(f"wrote {len(written)} plot(s) and {report} (plots in {out})", file=stream)


# ---- Watching a run ---------------------------------------------------------------------------------

BACKLOG_LINES = 20   # more new records than this in one poll: one line that counts them, then the newest


def progress_line(rec: dict) -> str:
    """One record as --watch shows it: step, loss, holdout accuracy and loss."""
    bits = [f"step {rec.get('step')}"]
    if math.isfinite(_num(rec.get("loss"))):
        bits.append(f"loss {_fmt(rec['loss'])}")
    h = rec.get("holdout_logits")
    if isinstance(h, dict):
        if math.isfinite(_num(h.get("accuracy"))):
            bits.append(f"holdout acc {h['accuracy']:.3f}")
        if math.isfinite(_num(h.get("loss"))):
            bits.append(f"holdout loss {_fmt(h['loss'])}")
    return "  ".join(bits)


class Watch:
    """--watch: poll the runs; a progress line per new record, each finding in full the first time it shows
    up, plots and a self-reloading report redrawn at most every --redraw seconds; done when every run has
    closed (run.json's ends)."""

    def __init__(self, runs, args, want_plots):
        self.runs, self.args, self.want_plots = runs, args, want_plots
        self.seen = set()                               # (run, code, group, severity) already told
        self.newest = {r.name: None for r in runs}      # the finding told last, per run
        self.notices_shown = {r.name: 0 for r in runs}
        self.waiting, self.closed = set(), set()        # run names
        self.drawn_at, self.undrawn = None, False       # last redraw (monotonic); records since it
        self.results = None

    def poll(self) -> bool:
        """Read what arrived and tell it; True when every run has closed."""
        added = [read_new_records(run, final=False) for run in self.runs]
        for run in self.runs:
            if not (run.path / RECORD_FILE).is_file() and run.name not in self.waiting:
                self.waiting.add(run.name)
                print(f"[{run.name}] waiting for {run.path / RECORD_FILE}", flush=True)
        if any(added) or self.results is None:
            self._tell(added)
        for run in self.runs:
            if run.name not in self.closed and (end := run_end(run)):
                self.closed.add(run.name)
                print(f"[{run.name}] run closed at {end}", flush=True)
        self._draw(final=False)
        return len(self.closed) == len(self.runs)

    def finish(self) -> int:
        self._tell([read_new_records(run, final=True) for run in self.runs])
        where = self._draw(final=True)
        print(f"watched {sum(len(r.records) for r in self.runs)} records; "
              f"{sum(len(f) for _, f, _ in self.results)} finding(s) now", flush=True)
        if where:
            _print_where(where, sys.stdout)
        critical = any(f.severity == "critical" for _, fs, _ in self.results for f in fs)
        return 1 if self.args.check and critical else 0

    def _tell(self, added):
        """Diagnose again; print the new records' progress lines (with the newest finding told before
        them), then each new finding in full, and the notices."""
        self.results = [(run, f := diagnose(run), summarize(run, f)) for run in self.runs]
        self.undrawn = self.undrawn or any(added)
        newest, told = dict(self.newest), []
        for run, findings, _ in self.results:
            # Keyed with the severity, so a warning that turns critical is told once more.
            new = [f for f in findings if (run.name, f.code, f.group, f.severity) not in self.seen]
            self.seen.update((run.name, f.code, f.group, f.severity) for f in new)
            if new:
                self.newest[run.name] = max(new, key=lambda f: SEVERITIES.index(f.severity))
            told += [(run, f) for f in new]
        for run, n in zip(self.runs, added):
            self._progress(run, n, newest[run.name])
        for run, f in told:
            step = run.records[-1]["step"] if run.records else "?"
            _emit(f"[{run.name}] step {step}: {f.severity.upper()} {f.code}: {f.message}", flush=True)
        for run in self.runs:
            for n in run.notices[self.notices_shown[run.name]:]:
                _emit(f"[{run.name}] notice: {n}", flush=True)
            self.notices_shown[run.name] = len(run.notices)

    @staticmethod
    def _progress(run, added, f):
        if not added:
            return
        recs = run.records[-added:]
        if added > BACKLOG_LINES:
            _emit(f"[{run.name}] {added:,} records, steps {recs[0].get('step')}-{recs[-1].get('step')}", flush=True)
            recs = recs[-1:]
        newest = f" | newest finding: {f.severity.upper()} {f.code}" if f else " | no findings"
        for rec in recs:
            _emit(f"[{run.name}] {progress_line(rec)}{newest}", flush=True)

    def _draw(self, final: bool):
        """Plots and report, when due: at the end, or records arrived and --redraw seconds have passed."""
        if not self.want_plots or not any(r.records for r in self.runs):
            return None
        due = self.undrawn and (self.drawn_at is None or time.monotonic() - self.drawn_at >= self.args.redraw)
        if not (final or due):
            return None
        self.drawn_at, self.undrawn = time.monotonic(), False
        refresh = None if final else max(self.args.redraw, self.args.interval)
        return _draw(self.runs, self.args, self.results, refresh)


def watch(runs, args, want_plots) -> int:
    """Follow the runs until they close, --max-seconds pass, or Ctrl-C; returns the exit status."""
    w = Watch(runs, args, want_plots)
    print(f"watching {', '.join(str(r.path) for r in runs)} every {args.interval:g}s until the run closes"
          f"{'' if len(runs) == 1 else 's close'} (Ctrl-C to stop)", flush=True)
    deadline = time.monotonic() + args.max_seconds if args.max_seconds else None
    try:
        while not w.poll():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                break
            time.sleep(args.interval if left is None else min(args.interval, left))
    except KeyboardInterrupt:
        print("\nstopped watching", flush=True)
    return w.finish()


def main(argv=None) -> int:
    try:
        return _main(argv)
    except CannotWrite as exc:   # after the diagnosis is printed: the run was read, an output was not written
        sys.stdout.flush()
        _emit(f"error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader went away (analyze_telemetry.py run | head): no traceback for that
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nor at the exit's flush of stdout
        return 1


def _main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if isinstance(np, _Missing):
        print(f"analyze_telemetry needs numpy: {INSTALL_HINT}", file=sys.stderr)
        return 2
    machine = args.json or args.check or args.csv
    want_plots = not args.no_plots and (args.plots or not machine)
    if want_plots and (why := plots_unavailable()):
        print(why, file=sys.stderr)   # the diagnosis goes on without them
        want_plots = False
    runs = []
    for d in args.run_dirs:
        run = new_run(d)
        if not args.watch and not run.path.is_dir():   # --watch waits for a run that is not there yet
            print(f"error: {d} is not a run directory", file=sys.stderr)
            return 2
        if not args.watch and not (run.path / RECORD_FILE).is_file():
            print(f"error: no {RECORD_FILE} in {run.path}{_why_no_records(run)}", file=sys.stderr)
            return 2
        runs.append(run)
    _unique_names(runs)
    if args.watch:
        return watch(runs, args, want_plots)
    for run in runs:
        read_new_records(run, final=True, progress=True)
    info = sys.stderr if args.json else sys.stdout
    # The diagnosis first: an output that cannot be written (a read-only run, a bad --csv) is told after it.
    results = [(run, f := diagnose(run), summarize(run, f)) for run in runs]
    if args.json:
        print(json.dumps(findings_json(results), indent=1, default=float, allow_nan=False))
    else:
        _emit(format_text(results))
    if args.csv:
        try:
            n = write_csv(runs, args.csv)
        except OSError as exc:
            raise CannotWrite(f"--csv {args.csv}", exc) from None
        print(f"wrote {n} rows to {args.csv}", file=info)
    if want_plots:
        _print_where(_draw(runs, args, results), info)
    if args.tensorboard:
        try:
            told = export_tensorboard(runs, args.tensorboard)
        except OSError as exc:
            raise CannotWrite(f"--tensorboard {args.tensorboard}", exc) from None
        print(told, file=info)
    if args.check:
        # A smoke test must not pass a run it could not judge: an empty file, or every line damaged.
        empty = [run for run in runs if not run.records]
        for run in empty:
            _emit(f"error: no readable record in {run.path / RECORD_FILE}: nothing to judge", file=sys.stderr)
        if empty:
            return 2
        return 1 if any(f.severity == "critical" for _, fs, _ in results for f in fs) else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
