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
        if {threads} > 1:  # the large-model path, whatever the model's size
            telemetry.CHUNK_BYTES, telemetry._pass_threads = 256, lambda tensors: {threads}
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
