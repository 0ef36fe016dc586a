"""Mixed precision: with a torch.amp.GradScaler the recorded gradient norms are unscaled, and the
`grad_scaler` section holds the scale and the number of skipped steps.

References are independent: torch.nn.utils.get_total_norm over gradients that the test copies right after
backward and divides by the scale itself, and skipped steps counted from weights that did not move.
"""

import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from telemetry import TelemetryConfig, TrainingTelemetry  # noqa: E402


def setup(tmp_path, fused=False, init_scale=1024.0, alerts=False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, fused=fused)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    telemetry = TrainingTelemetry(TelemetryConfig(output_dir=str(tmp_path), collect_every_n=1, strict=True,
                                                  track_holdout_logits=False, alerts=alerts))
    telemetry.set_grad_scaler(scaler)
    return model, optimizer, scaler, telemetry


def backward(model, scaler, step, blow_up=False):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(8, 5, generator=g), torch.randint(0, 2, (8,), generator=g)
    loss = torch.nn.functional.cross_entropy(model(x), y) * (1e38 if blow_up else 1.0)
    scaler.scale(loss).backward()
    return loss


def unscaled_norm(model, scale):
    return torch.nn.utils.get_total_norm([p.grad.detach().clone() / scale for p in model.parameters()]).item()


@pytest.mark.parametrize("fused", [False, True])
def test_norm_is_unscaled_when_scaler_step_unscaled_in_place(tmp_path, fused):
    # The usual order: scale(loss).backward(), scaler.step, scaler.update, on_batch_end. step() unscales
    # the gradients in place (fused SGD writes them back unscaled too), so nothing is divided twice.
    model, optimizer, scaler, telemetry = setup(tmp_path, fused=fused)
    for step in range(3):
        optimizer.zero_grad()
        backward(model, scaler, step)
        expected = unscaled_norm(model, scaler.get_scale())
        scaler.step(optimizer)
        scaler.update()
        record = telemetry.on_batch_end(model, optimizer, step, 0)
        assert math.isclose(record["gradient_norm"]["overall"], expected, rel_tol=1e-6)
        assert record["grad_scaler"] == {"scale": 1024.0, "skipped_steps": 0}


def test_norm_after_unscale_and_before_update(tmp_path):
    model, optimizer, scaler, telemetry = setup(tmp_path)
    optimizer.zero_grad()
    backward(model, scaler, 0)
    expected = unscaled_norm(model, scaler.get_scale())
    scaler.unscale_(optimizer)  # e.g. to clip
    scaler.step(optimizer)
    record = telemetry.on_batch_end(model, optimizer, 0, 0)  # before update(): the stage is STEPPED
    scaler.update()
    assert math.isclose(record["gradient_norm"]["overall"], expected, rel_tol=1e-6)


def test_gradients_captured_before_the_step_are_divided_by_the_scale(tmp_path):
    # capture_gradients runs before the step (Lightning's on_before_optimizer_step with a fused
    # optimizer, which it does not unscale): the gradients are still scaled there, so wandb #4369's
    # 1024x norm must not reach the record.
    model, optimizer, scaler, telemetry = setup(tmp_path)
    optimizer.zero_grad()
    backward(model, scaler, 0)
    expected = unscaled_norm(model, scaler.get_scale())
    scaled = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()
    assert telemetry.capture_gradients(model, optimizer, 0)
    scaler.step(optimizer)
    scaler.update()
    record = telemetry.on_batch_end(model, optimizer, 0, 0)
    assert math.isclose(record["gradient_norm"]["overall"], expected, rel_tol=1e-6)
    assert math.isclose(scaled / record["gradient_norm"]["overall"], 1024.0, rel_tol=1e-5)


def test_skipped_steps_and_scale(tmp_path):
    """A step the scaler skipped is a step of the loop, as the HF Trainer and Lightning count them: recorded,
    marked skipped, its inf gradients null and listed, and no alert raised for what the scaler dealt with."""
    model, optimizer, scaler, telemetry = setup(tmp_path, init_scale=2.0 ** 16, alerts=True)
    blow_ups = {1, 2, 4}
    skipped, records = 0, []
    for step in range(6):
        optimizer.zero_grad()
        before = [p.detach().clone() for p in model.parameters()]
        backward(model, scaler, step, blow_up=step in blow_ups)
        scaler.step(optimizer)
        scaler.update()
        skipped += all(torch.equal(b, p) for b, p in zip(before, model.parameters()))  # the step was skipped
        records.append(telemetry.on_batch_end(model, optimizer, step, 0))
        assert records[-1]["grad_scaler"] == {"scale": scaler.get_scale(), "skipped_steps": skipped,
                                              **({"skipped": True} if step in blow_ups else {})}
        assert "alerts" not in records[-1]
    assert skipped == 3 and records[-1]["grad_scaler"]["scale"] == 2.0 ** 13
    # A skipped step's gradients hold inf: recorded as null and listed, never as a number.
    assert records[1]["gradient_norm"]["overall"] is None and "gradient_norm.overall" in records[1]["nonfinite"]


def test_the_analyzer_passes_over_routine_skips_and_names_a_scaler_that_skips_every_step(tmp_path):
    """Two overflowing steps out of 40 are the scaler finding its scale: no finding. Overflowing at every step
    from step 20 on, whatever the scale backs off to, is a run that stopped training: a critical nonfinite
    that says the scaler skipped them."""
    at = pytest.importorskip("analyze_telemetry", reason="the analyzer needs numpy")

    def run(out, overflows):
        model, optimizer, scaler, telemetry = setup(out, alerts=True)
        for step in range(40):
            optimizer.zero_grad()
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(8, 5, generator=g), torch.randint(0, 2, (8,), generator=g)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            scaler.scale(loss * (math.inf if step in overflows else 1.0)).backward()
            scaler.step(optimizer)
            scaler.update()
            telemetry.on_batch_end(model, optimizer, step, 0, loss=loss)
        telemetry.close()
        found = at.diagnose(at.load_run(out, progress=False))
        return found + [c for f in found for c in f.consequences]

    routine = run(tmp_path / "routine", {5, 17})
    assert not [f for f in routine if f.severity in ("critical", "warning")], [(f.code, f.message) for f in routine]
    stuck = [f for f in run(tmp_path / "stuck", set(range(20, 40))) if f.code == "nonfinite"]
    assert len(stuck) == 1 and stuck[0].severity == "critical"
    assert "The GradScaler skipped the step at 20 of them" in stuck[0].message
