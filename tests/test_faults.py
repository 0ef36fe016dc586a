"""Faults: a full disk, crashes at any point, hostile or damaged files, two writers. Training goes on, nothing
is lost before a torn line, and every number recorded after a recovery is right.

A full disk is simulated per process with RLIMIT_FSIZE (writes that would grow a file past the limit fail
with EFBIG, an OSError like ENOSPC), in a subprocess so that pytest's own files are not limited.
"""

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from telemetry import TelemetryConfig, TrainingTelemetry  # noqa: E402

needs_rlimit = pytest.mark.skipif(importlib.util.find_spec("resource") is None,
                                  reason="needs RLIMIT_FSIZE to simulate a full disk")

PRELUDE = textwrap.dedent("""
    import json, os, resource, signal, sys, warnings
    sys.path.insert(0, {root!r})
    import torch
    from torch import nn
    from telemetry import TelemetryConfig, TrainingTelemetry

    def full_disk(limit):
        # Writes past `limit` bytes fail with EFBIG instead of killing the process with SIGXFSZ.
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    def model_and_optimizer():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    def step(model, optimizer, i):
        g = torch.Generator().manual_seed(i)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(torch.randn(12, 8, generator=g)), torch.randint(0, 3, (12,), generator=g)).backward()
        optimizer.step()

    warnings.simplefilter("always")
""")


def run_script(body, tmp_path, timeout=120):
    script = PRELUDE.format(root=ROOT) + textwrap.dedent(body)
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@needs_rlimit
def test_full_disk_warns_once_training_goes_on_and_close_does_not_raise(tmp_path):
    got = run_script("""
        run = os.path.join(sys.argv[1], "run")
        model, optimizer = model_and_optimizer()
        twin, twin_optimizer = model_and_optimizer()
        full_disk(200)  # run.json (about 1.5 KB) cannot be written, nor anything after it
        with warnings.catch_warnings(record=True) as caught:
            with TrainingTelemetry(TelemetryConfig(output_dir=run, collect_every_n=1)) as tel:
                for i in range(3):
                    step(model, optimizer, i)
                    step(twin, twin_optimizer, i)
                    tel.on_batch_end(model, optimizer, i, 0)
        after_close = True  # code after the with block runs: close() did not raise
        same = all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))
        print(json.dumps({"warnings": [str(w.message) for w in caught], "after": after_close, "same": same,
                          "reference": os.path.exists(os.path.join(run, "last_checkpoint.safetensors"))}))
    """, tmp_path)
    disk = [w for w in got["warnings"] if "cannot write" in w]
    assert len(disk) == 1 and "training goes on" in disk[0], got["warnings"]
    assert got["after"] and got["same"] and not got["reference"]


@needs_rlimit
@pytest.mark.parametrize("threads", [1, 3], ids=["one-thread", "written-alongside-the-pass"])
def test_failed_reference_write_keeps_the_delta_and_the_old_reference(tmp_path, threads):
    """The new reference is written while the old one is streamed (on threads for large models): when that
    write fails, the delta already measured is still recorded and the old reference stays intact."""
    got = run_script(f"""
        import telemetry
        if {threads} > 1:  # the large-model path, whatever the model's size: written from the pass's reads
            telemetry.CHUNK_BYTES, telemetry.WHOLE_PASS_BYTES = 256, 0
            telemetry._pass_threads = lambda tensors: {threads}
        run = os.path.join(sys.argv[1], "run")
        model, optimizer = model_and_optimizer()
        tel = TrainingTelemetry(TelemetryConfig(output_dir=run, collect_every_n=1, track_update_ratio=False))
        for i in range(2):
            step(model, optimizer, i)
            tel.on_batch_end(model, optimizer, i, 0)
        reference = os.path.join(run, "last_checkpoint.safetensors")
        before = open(reference, "rb").read()
        kept = [p.detach().clone() for p in model.parameters()]
        os.remove(reference + ".spare")  # the next write goes to a new file, which the limit stops
        full_disk(len(before) - 1)
        step(model, optimizer, 2)
        with warnings.catch_warnings(record=True) as caught:
            rec = tel.on_batch_end(model, optimizer, 2, 0)
        tel.close()
        expect = sum(float((p.detach().double() - k.double()).square().sum())
                     for p, k in zip(model.parameters(), kept)) ** 0.5
        print(json.dumps({{"delta": rec["weight_delta"]["overall"], "expect": expect,
                          "warned": any("cannot write" in str(w.message) for w in caught),
                          "unchanged": open(reference, "rb").read() == before}}))
    """, tmp_path)
    assert got["delta"] == pytest.approx(got["expect"], rel=1e-5)
    assert got["warned"] and got["unchanged"]


# ---- crashes at any point ------------------------------------------------------------------------------

import contextlib  # noqa: E402
import math  # noqa: E402
import random  # noqa: E402
import signal  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402

from torch import nn  # noqa: E402

import telemetry  # noqa: E402

STEPS = 6  # training steps of a crashing run, one collection each


def tiny_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


def train_step(model, optimizer, step):
    g = torch.Generator().manual_seed(step)
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(torch.randn(12, 8, generator=g)), torch.randint(0, 3, (12,), generator=g)).backward()
    optimizer.step()


def collecting_run(run):
    """The tiny model, its SGD and a TrainingTelemetry collecting at every step in `run`."""
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, optimizer, TrainingTelemetry(TelemetryConfig(output_dir=str(run), collect_every_n=1, alerts=False))


def collect_steps(model, optimizer, tel, steps):
    """Train each step and call the hook after it."""
    for step in steps:
        train_step(model, optimizer, step)
        tel.on_batch_end(model, optimizer, step, 0)


def replayed_weights(steps):
    """The weights after each training step, from a run without telemetry (the training is deterministic)."""
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    weights = [[p.detach().clone() for p in model.parameters()]]
    for step in range(1, steps + 1):
        train_step(model, optimizer, step)
        weights.append([p.detach().clone() for p in model.parameters()])
    return weights


def crash_config(run, sparse=False):
    return TelemetryConfig(output_dir=str(run), collect_every_n=1, alerts=False, track_system=False,
                           track_sparse_quality=sparse)


def crash_telemetry(run, sparse):
    """The crashing run's telemetry; with sparse, track_sparse_quality on a fixed holdout, which also keeps the
    previous reference at every collection."""
    tel = TrainingTelemetry(crash_config(run, sparse))
    if sparse:
        g = torch.Generator().manual_seed(99)
        tel.set_holdout_data((torch.randn(10, 8, generator=g), torch.randint(0, 3, (10,), generator=g)))
    return tel


def _crashing_child(run, kill_before_op, sparse):
    """In a forked child: train with telemetry and be killed (SIGKILL) just before the kill_before_op-th file
    operation, or by the parent at a random time."""
    torch.set_num_threads(1)
    if kill_before_op:
        count = [0]
        for name in ("open", "write", "pwrite", "replace", "link", "remove", "unlink", "ftruncate"):
            real = getattr(os, name)

            def counted(*args, _real=real, **kwargs):
                count[0] += 1
                if count[0] == kill_before_op:
                    os.kill(os.getpid(), signal.SIGKILL)
                return _real(*args, **kwargs)
            setattr(os, name, counted)
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tel = crash_telemetry(run, sparse)
    for step in range(1, STEPS + 1):
        train_step(model, optimizer, step)
        tel.on_batch_end(model, optimizer, step, 0)
    tel.close()


def crash(run, kill_before_op=None, after=None, sparse=False):
    """Run _crashing_child in a fork; True when it was killed before it finished."""
    pid = os.fork()
    if pid == 0:  # the child never returns into pytest
        code = 0
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                _crashing_child(run, kill_before_op, sparse)
        except BaseException:
            code = 1
        os._exit(code)
    if after is not None:
        time.sleep(after)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    assert not (os.WIFEXITED(status) and os.WEXITSTATUS(status)), "the crashing run failed on its own"
    return os.WIFSIGNALED(status)


def check_recovery(run, weights, sparse=False):
    """After a crash: every complete line is a record, in step order from 1 (none lost before a torn line);
    the reference on disk is sound and at most one collection ahead of the log; a resumed run's first delta
    is the true distance from the step the reference holds."""
    path = run / "telemetry.jsonl"
    raw = path.read_bytes() if path.exists() else b""
    complete = raw.split(b"\n")[:-1]
    assert not raw or raw.endswith(b"\n")  # a record is one write: no torn line
    records = [json.loads(line) for line in complete]
    assert [r["step"] for r in records] == list(range(1, len(records) + 1))
    reference = run / "last_checkpoint.safetensors"
    held = None
    assert reference.exists() or not records  # the reference is never missing once a record is written
    if reference.exists():
        _, _, metadata = telemetry.tensor_file_info(str(reference))
        held = int(metadata["step"])
        assert len(records) <= held <= len(records) + 1
    info = run / "run.json"  # written atomically: if it is there, it is whole
    starts = len(json.loads(info.read_text())["starts"]) if info.exists() else 0
    model = tiny_model()  # the same script run again: training starts over, telemetry resumes
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tel = crash_telemetry(run, sparse)
        train_step(model, optimizer, 1)
        rec = tel.on_batch_end(model, optimizer, 1, 0)
        tel.close()
    assert rec["step"] == len(records) + 1 and rec["start"] == starts
    if held is None:
        assert rec["weight_delta"]["overall"] is None
    else:
        true = math.sqrt(sum(float((a.double() - b.double()).square().sum()) for a, b in zip(weights[1], weights[held])))
        assert rec["reference_step"] == held
        assert rec["weight_delta"]["overall"] == pytest.approx(true, rel=1e-5, abs=1e-7)
    lines = path.read_bytes().split(b"\n")[:-1]
    assert json.loads(lines[-1])["step"] == rec["step"]  # the resumed record is a line of its own


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the crash campaign forks")
@pytest.mark.parametrize("chunked", [False, True], ids=["whole-pass", "reference-written-from-the-pass"])
def test_kill_campaign_loses_nothing_and_resumes_right(tmp_path, monkeypatch, chunked):
    weights = replayed_weights(STEPS)
    if chunked:  # the large-model path whatever the size, in the forked children and the resumed runs alike
        monkeypatch.setattr(telemetry, "CHUNK_BYTES", 256)
        monkeypatch.setattr(telemetry, "WHOLE_PASS_BYTES", 0)
    started, kills = time.time(), 0
    # Every file operation of the first three collections (about 55 of them, from the constructor's run.json
    # to the third reference write and record; the chunked path's pwrites add 5 a collection), one crash
    # each; then crashes at random times.
    for n in range(1, 75 if chunked else 60):
        run = tmp_path / f"op{n}"
        kills += crash(run, kill_before_op=n)
        check_recovery(run, weights)
    rng = random.Random(20261123)
    for k in range(8):
        run = tmp_path / f"random{k}"
        kills += crash(run, after=rng.uniform(0.0, 0.15))
        check_recovery(run, weights)
    assert kills >= 20 and time.time() - started < 60


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the crash campaign forks")
def test_kill_campaign_with_sparse_quality_never_loses_the_reference(tmp_path):
    """track_sparse_quality keeps the reference a collection replaces: killed at each file operation of the
    first collections, the reference is still there and sound, and the resumed delta is right."""
    weights = replayed_weights(STEPS)
    kills = 0
    for n in range(1, 50):
        run = tmp_path / f"op{n}"
        kills += crash(run, kill_before_op=n, sparse=True)
        check_recovery(run, weights, sparse=True)
    assert kills >= 20


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "fork"), reason="the crash campaign forks")
def test_long_kill_campaign(tmp_path):
    """pytest -m slow: 300 crashes at random times."""
    weights = replayed_weights(STEPS)
    rng = random.Random(7)
    for k in range(300):
        run = tmp_path / f"random{k}"
        crash(run, after=rng.uniform(0.0, 0.3))
        check_recovery(run, weights)


# ---- hostile and damaged files in output_dir ----------------------------------------------------------


@contextlib.contextmanager
def deadline(seconds):
    """Fail instead of hanging (a FIFO opened for reading blocks until a writer comes)."""
    def expired(*_):
        raise TimeoutError(f"still running after {seconds} s")
    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def train_and_check(run, steps=3, **config):
    """Train with telemetry on `run`; every delta after the first must be the true distance (kept copies).
    Returns (records, warnings raised)."""
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    records = []
    with warnings.catch_warnings(record=True) as caught, deadline(30):
        warnings.simplefilter("always")
        tel = TrainingTelemetry(TelemetryConfig(output_dir=str(run), collect_every_n=1, alerts=False, **config))
        kept = None
        for step in range(1, steps + 1):
            train_step(model, optimizer, step)
            records.append(tel.on_batch_end(model, optimizer, step, 0))
            if kept is not None and step > 2:
                true = math.sqrt(sum(float((p.detach().double() - k.double()).square().sum())
                                     for p, k in zip(model.parameters(), kept)))
                assert records[-1]["weight_delta"]["overall"] == pytest.approx(true, rel=1e-5)
            kept = [p.detach().clone() for p in model.parameters()]
        tel.close()
    return records, [str(w.message) for w in caught]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
@pytest.mark.parametrize("name", ["last_checkpoint.safetensors", "telemetry.jsonl", "run.json",
                                  "initial_weights.safetensors", "last_checkpoint.safetensors.spare"])
def test_a_fifo_in_place_of_a_file_is_set_aside_not_opened(tmp_path, name):
    run = tmp_path / "run"
    run.mkdir()
    os.mkfifo(run / name)
    records, caught = train_and_check(run)
    assert len(records) == 3 and all(r is not None for r in records)
    aside = [w for w in caught if "not a regular file" in w]
    assert len(aside) == 1 and name in aside[0] and (run / f"{name}.aside-1").exists()


def test_a_directory_or_link_in_place_of_a_file_is_set_aside(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (run / "last_checkpoint.safetensors").mkdir()
    os.symlink(victim, run / "telemetry.jsonl")
    records, caught = train_and_check(run)
    assert victim.read_text() == "precious" and len(read_lines(run)) == 3
    assert len([w for w in caught if "not a regular file" in w]) == 1


def read_lines(run):
    return [json.loads(line) for line in (run / "telemetry.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("name", ["run.json.tmp", "last_checkpoint.safetensors.tmp",
                                  "initial_weights.safetensors.tmp", "last_checkpoint.safetensors.prev"])
def test_a_link_planted_at_a_side_file_mid_run_is_never_written_through(tmp_path, name):
    run = tmp_path / "run"
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    model, optimizer, tel = collecting_run(run)
    os.symlink(victim, run / name)  # planted after the constructor looked
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        collect_steps(model, optimizer, tel, range(1, 4))
        tel.set_holdout_data((torch.randn(4, 8), torch.tensor([0, 1, 2, 0])))  # one more run.json write
    tel.close()
    assert victim.read_text() == "precious" and len(read_lines(run)) == 3


DAMAGED_RUN_JSON = {
    "a list": b"[]",
    "starts not a list": b'{"starts": 5}',
    "deeply nested": b"[" * 100000 + b"]" * 100000,
    "not JSON": b'{"starts": ["2026-01-01T00:00:00"',
    "not UTF-8": b'{"starts": ["\xff\xfe"]}',
    "starts of numbers": b'{"starts": [1, 2]}',
}


@pytest.mark.parametrize("kind", list(DAMAGED_RUN_JSON))
def test_a_damaged_run_json_is_kept_aside_and_named(tmp_path, kind):
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_bytes(DAMAGED_RUN_JSON[kind])
    records, caught = train_and_check(run)
    named = [w for w in caught if "run.json" in w and "damaged" in w]
    assert len(named) == 1 and "run.json.damaged-1" in named[0]
    assert (run / "run.json.damaged-1").read_bytes() == DAMAGED_RUN_JSON[kind]
    assert len(json.loads((run / "run.json").read_text())["starts"]) == 1


DAMAGED_TAILS = {
    "Infinity": b'{"step": Infinity}\n',
    "a 400-digit number": b'{"step": 1' + b"0" * 400 + b"}\n",
    "1e400": b'{"step": 1e400}\n',
    "deep nesting": b"[" * 100000 + b"]" * 100000 + b"\n",
    "garbage": b"\x00\x01garbage\n",
    "a torn line": b'{"step": 3, "loss": 0.',
    "a step that is a string": b'{"step": "3"}\n',
}


@pytest.mark.parametrize("kind", list(DAMAGED_TAILS))
def test_a_damaged_last_line_is_named_and_the_run_resumes_after_the_last_record(tmp_path, kind):
    run = tmp_path / "run"
    train_and_check(run, steps=2)
    with open(run / "telemetry.jsonl", "ab") as f:
        f.write(DAMAGED_TAILS[kind])
    records, caught = train_and_check(run, steps=2)
    assert [r["step"] for r in records] == [3, 4]
    assert len([w for w in caught if "not records" in w]) == 1
    assert read_lines_tolerant(run)[-1]["step"] == 4


def read_lines_tolerant(run):
    out = []
    for line in (run / "telemetry.jsonl").read_bytes().splitlines():
        with contextlib.suppress(ValueError, RecursionError, UnicodeDecodeError):
            out.append(json.loads(line))
    return [r for r in out if isinstance(r, dict)]


def _reference_damage(path):
    """Each way a reference file can be damaged: (name, function that damages the file at path)."""
    def rewrite_header(edit):
        def damage():
            raw = path.read_bytes()
            n = int.from_bytes(raw[:8], "little")
            header = json.loads(raw[8:8 + n])
            edit(header)
            blob = json.dumps(header).encode()
            path.write_bytes(len(blob).to_bytes(8, "little") + blob + raw[8 + n:])
        return damage

    def first(header):
        return next(v for k, v in header.items() if k != "__metadata__")

    def zip_file():
        torch.save({"w": torch.ones(3)}, str(path))

    return {
        "truncated data": lambda: path.write_bytes(path.read_bytes()[:-10]),
        "truncated header": lambda: path.write_bytes(path.read_bytes()[:20]),
        "empty": lambda: path.write_bytes(b""),
        "header length 2^63": lambda: path.write_bytes((2 ** 63).to_bytes(8, "little") + path.read_bytes()[8:]),
        "offsets past the end": rewrite_header(lambda h: first(h).update(data_offsets=[0, 10 ** 12])),
        "negative offsets": rewrite_header(lambda h: first(h).update(data_offsets=[-8, 24])),
        "huge shape": rewrite_header(lambda h: first(h).update(shape=[10 ** 12, 10 ** 12])),
        "unknown dtype": rewrite_header(lambda h: first(h).update(dtype="Q99")),
        "overlapping tensors": rewrite_header(lambda h: [v.update(data_offsets=[0, v["data_offsets"][1] - v["data_offsets"][0]]) for k, v in h.items() if k != "__metadata__"]),
        "a torch.save zip": zip_file,
    }


@pytest.mark.parametrize("kind", list(_reference_damage(None)))
@pytest.mark.parametrize("which", ["last_checkpoint.safetensors", "initial_weights.safetensors"])
def test_a_damaged_reference_is_refused_rewritten_and_measured_again(tmp_path, kind, which):
    run = tmp_path / "run"
    model, optimizer, tel = collecting_run(run)
    collect_steps(model, optimizer, tel, (1, 2))
    _reference_damage(run / which)[kind]()
    w0 = replayed_weights(1)[1]  # the weights the initial file holds: those after the first step
    records = []
    with warnings.catch_warnings(record=True) as caught, deadline(30):
        warnings.simplefilter("always")
        for step in (3, 4):
            kept = [p.detach().clone() for p in model.parameters()]
            train_step(model, optimizer, step)
            records.append(tel.on_batch_end(model, optimizer, step, 0))
    tel.close()
    assert len([w for w in caught if "is damaged" in str(w.message)]) == 1
    true = math.sqrt(sum(float((p.detach().double() - k.double()).square().sum())
                         for p, k in zip(model.parameters(), kept)))
    if which.startswith("last"):  # not measured against damage: null, then right again
        assert records[0]["weight_delta"]["overall"] is None
        assert records[1]["weight_delta"]["overall"] == pytest.approx(true, rel=1e-5)
    else:  # drift restarts from the rewritten W_0 (the weights at step 3)
        assert records[1]["weight_delta"]["overall"] == pytest.approx(true, rel=1e-5)
        assert records[0]["drift"]["overall"] == 0.0 and records[1]["drift"]["overall"] == pytest.approx(true, rel=1e-5)
    assert w0 is not None
    telemetry.tensor_file_info(str(run / which))  # sound again


# ---- one writer per run directory ----------------------------------------------------------------------


def test_a_second_writer_is_refused_and_the_first_measures_right(tmp_path):
    run = tmp_path / "run"
    first = TrainingTelemetry(TelemetryConfig(output_dir=str(run), collect_every_n=1, alerts=False))
    with pytest.raises(RuntimeError, match=r"is in use by another TrainingTelemetry \(process \d+\).*own output_dir"):
        TrainingTelemetry(TelemetryConfig(output_dir=str(run), collect_every_n=1))
    # Another process is refused too (the lock is the OS's, not this process's).
    proc = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {ROOT!r}); "
                           f"from telemetry import *; TrainingTelemetry(TelemetryConfig(output_dir={str(run)!r}))"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "is in use by another TrainingTelemetry" in proc.stderr
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    weights = replayed_weights(4)
    for step in range(1, 5):
        train_step(model, optimizer, step)
        rec = first.on_batch_end(model, optimizer, step, 0)
        if step > 1:
            true = math.sqrt(sum(float((a.double() - b.double()).square().sum())
                                 for a, b in zip(weights[step], weights[step - 1])))
            assert rec["weight_delta"]["overall"] == pytest.approx(true, rel=1e-5)
    # A forked child (a DataLoader worker) does not keep the lock once the parent closes.
    r, w = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(w)
        os.read(r, 1)  # alive until the parent has tried
        os._exit(0)
    try:
        first.close()
        with pytest.warns(RuntimeWarning, match="called after close"):
            assert first.on_batch_end(model, optimizer, 5, 0) is None  # nothing written: the lock is let go
        second = TrainingTelemetry(TelemetryConfig(output_dir=str(run)))  # free again once closed
        second.close()
    finally:
        os.close(w)
        os.waitpid(child, 0)
    assert [rec["step"] for rec in read_lines(run)] == [1, 2, 3, 4]


@needs_rlimit
def test_a_full_disk_at_construction_warns_and_training_goes_on(tmp_path):
    """Nothing fits, not even the lock file's pid: the constructor warns and turns telemetry off rather than
    raise into the training script, and the directory is free for another try once the space is back."""
    got = run_script("""
        run = os.path.join(sys.argv[1], "run")
        model, optimizer = model_and_optimizer()
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        full_disk(0)
        with warnings.catch_warnings(record=True) as caught:
            tel = TrainingTelemetry(TelemetryConfig(output_dir=run, collect_every_n=1))
            for i in range(3):
                step(model, optimizer, i)
                tel.on_batch_end(model, optimizer, i, 0)
            tel.close()
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        again = TrainingTelemetry(TelemetryConfig(output_dir=run, collect_every_n=1))
        step(model, optimizer, 3)
        record = again.on_batch_end(model, optimizer, 0, 0)
        again.close()
        print(json.dumps({"warnings": [str(w.message) for w in caught], "step": record["step"]}))
    """, tmp_path)
    assert len([w for w in got["warnings"] if "cannot write" in w]) == 1, got["warnings"]
    assert not [w for w in got["warnings"] if "nothing collected" in w]
    assert got["step"] == 1


# ---- nothing reaches the loop ------------------------------------------------------------------------------


def test_under_python_W_error_nothing_reaches_the_loop(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text("[]")  # damage, which warns
    script = PRELUDE.format(root=ROOT) + textwrap.dedent(f"""
        model, optimizer = model_and_optimizer()
        tel = TrainingTelemetry(TelemetryConfig(output_dir={str(run)!r}, collect_every_n=1))
        tel.add_metric("broken", lambda m, o, c: 1 / 0)
        tel.set_holdout_data((torch.randn(4, 8), torch.tensor([0, 1, 2, 0])), forward=lambda m, b: 1 / 0)
        for i in range(3):
            step(model, optimizer, i)
            tel.on_batch_end(model, optimizer, i, 0)
        optimizer.zero_grad()
        tel.on_batch_end(model, optimizer, 3, 0)  # no gradients: a warning too
        tel.close()
        print(json.dumps({{"ok": True}}))
    """).replace('warnings.simplefilter("always")', "")
    proc = subprocess.run([sys.executable, "-W", "error", "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "telemetry" in proc.stderr  # the warnings went to the log instead


def test_the_rng_is_restored_around_custom_metrics(tmp_path):
    import numpy as np

    def run(with_telemetry):
        torch.manual_seed(0)
        random.seed(0)
        np.random.seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.3), nn.Linear(16, 3))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        tel = TrainingTelemetry(TelemetryConfig(output_dir=str(tmp_path / str(with_telemetry)), collect_every_n=1))
        tel.add_metric("noisy", lambda m, o, c: {"t": torch.rand(()), "p": random.random(), "n": np.random.rand()})
        for i in range(4):
            optimizer.zero_grad()
            x = torch.randn(12, 8) + random.random() + float(np.random.rand())
            nn.functional.cross_entropy(model(x), torch.randint(0, 3, (12,))).backward()
            optimizer.step()
            if with_telemetry:
                tel.on_batch_end(model, optimizer, i, 0)
        tel.close()
        return [p.detach().clone() for p in model.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(run(True), run(False)))


@needs_rlimit
def test_a_record_cut_short_by_a_full_disk_leaves_no_torn_line(tmp_path):
    """The disk fills in the middle of a record's line: what was written of it is cut off again, so the file
    still ends with the last whole record, and a resume finds no damaged line to name."""
    got = run_script("""
        run = os.path.join(sys.argv[1], "run")
        model, optimizer = model_and_optimizer()
        tel = TrainingTelemetry(TelemetryConfig(output_dir=run, collect_every_n=1))
        for i in range(8):
            step(model, optimizer, i)
            tel.on_batch_end(model, optimizer, i, 0)
        records = os.path.join(run, "telemetry.jsonl")
        size = os.path.getsize(records)
        full_disk(size + size // 16)  # room for half a record's line, and the reference is rewritten in place
        with warnings.catch_warnings(record=True) as caught:
            for i in range(8, 11):
                step(model, optimizer, i)
                tel.on_batch_end(model, optimizer, i, 0)
        tel.close()
        raw = open(records, "rb").read()
        print(json.dumps({"before": size, "after": len(raw), "steps": [json.loads(l)["step"] for l in raw.splitlines()],
                          "warnings": [str(w.message) for w in caught]}))
    """, tmp_path)
    assert got["after"] == got["before"] and got["steps"] == list(range(1, 9))
    assert [w for w in got["warnings"] if "cannot write" in w], got["warnings"]


def test_a_hard_link_to_a_reference_keeps_what_it_held(tmp_path):
    """A user keeps the reference of step 2 under another name (ln): the spare that the rewrites reuse in place
    is then not rewritten through it, and the kept file still holds step 2 later."""
    from safetensors.torch import load_file

    run = tmp_path / "run"
    model, optimizer, tel = collecting_run(run)
    collect_steps(model, optimizer, tel, (1, 2))
    os.link(run / "last_checkpoint.safetensors", tmp_path / "kept.safetensors")
    kept = {n: p.detach().clone() for n, p in model.named_parameters()}
    collect_steps(model, optimizer, tel, range(3, 7))
    tel.close()
    loaded = load_file(str(tmp_path / "kept.safetensors"))
    assert all(torch.equal(loaded[n], kept[n]) for n in kept)


def test_an_output_dir_that_is_a_dangling_link_is_named(tmp_path):
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling")
    with pytest.raises(ValueError, match=r"output_dir: .*dangling' is a symbolic link to nothing"):
        TrainingTelemetry(TelemetryConfig(output_dir=str(tmp_path / "dangling")))


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads the process's maps from /proc")
def test_close_lets_go_of_the_reference_files(tmp_path):
    """After close() no map or descriptor of the run's files stays open (a filesystem could not be unmounted)."""
    import gc

    run = tmp_path / "run"
    model, optimizer, tel = collecting_run(run)
    collect_steps(model, optimizer, tel, range(1, 4))
    assert str(run) in open("/proc/self/maps").read()
    tel.close()
    gc.collect()
    assert str(run) not in open("/proc/self/maps").read()
    assert not [fd for fd in os.listdir("/proc/self/fd") if str(run) in os.path.realpath(f"/proc/self/fd/{fd}")]
