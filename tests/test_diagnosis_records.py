"""What the analyzer's diagnosis needs from the records, each number checked another way: frozen parameters
per group, the gradient norm per layer, activation health over the holdout, a fingerprint of each batch."""

import json
import math
import os
import sys

import pytest
import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from telemetry import TelemetryConfig, TrainingTelemetry  # noqa: E402


def step(model, optimizer, x, y):
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()


def test_a_group_frozen_with_requires_grad_keeps_its_learning_rate_and_counts(tmp_path):
    torch.manual_seed(0)
    model = nn.ModuleDict({"backbone": nn.Linear(8, 16), "head": nn.Linear(16, 3)})
    optimizer = torch.optim.Adam([{"params": model["backbone"].parameters(), "lr": 1e-3, "name": "backbone"},
                                  {"params": model["head"].parameters(), "lr": 1e-2, "name": "head"}])
    model["backbone"].requires_grad_(False)  # frozen after the optimizer was built: its group keeps an lr
    tel = TrainingTelemetry(TelemetryConfig(output_dir=str(tmp_path), collect_every_n=1, strict=True))
    x, y = torch.randn(12, 8), torch.randint(0, 3, (12,))
    optimizer.zero_grad()
    nn.functional.cross_entropy(model["head"](torch.relu(model["backbone"](x))), y).backward()
    optimizer.step()
    rec = tel.on_batch_end(model, optimizer, 0, 0)
    tel.close()
    groups = json.loads((tmp_path / "run.json").read_text())["groups"]
    assert groups["backbone"] == {"tensors": 0, "elements": 0, "names": [], "frozen_tensors": 2,
                                  "frozen_elements": 8 * 16 + 16, "frozen_names": ["backbone.weight", "backbone.bias"]}
    assert groups["head"]["tensors"] == 2 and "frozen_tensors" not in groups["head"]
    assert rec["learning_rates"] == {"overall": 1e-2, "head": 1e-2, "backbone": 1e-3}
    assert set(rec["gradient_norm"]) == {"overall", "head"}


def test_gradient_profile_per_layer_matches_get_total_norm(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tel = TrainingTelemetry(TelemetryConfig(output_dir=str(tmp_path), collect_every_n=1, strict=True))
    step(model, optimizer, torch.randn(12, 8), torch.randint(0, 3, (12,)))
    profile = tel.on_batch_end(model, optimizer, 0, 0)["grad_profile"]
    tel.close()
    assert list(profile) == ["0", "2", "4"]
    for layer in profile:
        want = torch.nn.utils.get_total_norm([p.grad for p in model[int(layer)].parameters()]).item()
        assert profile[layer] == pytest.approx(want, rel=1e-6)


def test_activation_health_matches_a_manual_pass_and_costs_nothing_between_collections(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 3))
    with torch.no_grad():
        model[0].bias[:20] = -50.0  # 20 of 32 units never fire
        model[2].weight.mul_(30.0)  # tanh pushed onto its flat ends
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    tel = TrainingTelemetry(TelemetryConfig(output_dir=str(tmp_path), collect_every_n=2, strict=True))
    hx, hy = torch.randn(40, 8), torch.randint(0, 3, (40,))
    tel.set_holdout_data((hx, hy))
    records = []
    for i in range(1, 5):
        step(model, optimizer, torch.randn(12, 8), torch.randint(0, 3, (12,)))
        hooks = sum(len(m._forward_hooks) for m in model.modules())
        assert hooks == 0  # nothing watches the training forward
        records.append(tel.on_batch_end(model, optimizer, i, 0))
    tel.close()
    with torch.no_grad():
        relu = model[1](model[0](hx))
        tanh = model[3](model[2](relu))
    got = records[1]["activations"]
    assert got["1"] == {"kind": "relu", "units": 32,
                        "dead": pytest.approx(1 - (relu > 0).any(0).double().mean().item())}
    assert got["1"]["dead"] == pytest.approx(20 / 32)
    assert got["3"]["saturated"] == pytest.approx((tanh.abs() > 0.99).double().mean().item(), rel=1e-6)
    assert got["3"]["saturated"] > 0.3


def test_batch_fingerprint_repeats_exactly_with_the_batch(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(8, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tel = TrainingTelemetry(TelemetryConfig(output_dir=str(tmp_path), collect_every_n=1, strict=True))
    same, other = (torch.randn(12, 8), torch.randint(0, 3, (12,))), (torch.randn(12, 8), torch.randint(0, 3, (12,)))
    prints = []
    for batch in (same, other, same):
        step(model, optimizer, *batch)
        stats = tel.on_batch_end(model, optimizer, 0, 0, batch=batch)["batch_stats"]
        prints.append(stats["fingerprint"])
        # the inputs' scale: the root mean square per element, from the sum of squares and the element count
        rms = math.sqrt(stats["fingerprint"][1] / stats["input_elements"])
        assert rms == pytest.approx(batch[0].double().square().mean().sqrt().item(), rel=1e-6)
    # token ids have no scale: no element count beside their fingerprint
    ids = {"input_ids": torch.randint(0, 50, (4, 6)), "label": torch.randint(0, 3, (4,))}
    step(model, optimizer, *other)
    stats = tel.on_batch_end(model, optimizer, 0, 0, batch=ids)["batch_stats"]
    assert "fingerprint" in stats and "input_elements" not in stats
    tel.close()
    assert prints[0] == prints[2] != prints[1]
    assert prints[0] == [pytest.approx(same[0].double().sum().item()), pytest.approx(same[0].double().square().sum().item())]
