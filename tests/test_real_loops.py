"""Real training loops, not only the example's: every form of data, output and loop a user's code gives is
either recorded right (checked against a manual eval() pass, a float64 sum or the gradient saved at the
step) or refused at the call where the mistake is made, with a message that says what to pass.

Data: scikit-learn's bundled digits (8x8 images, 10 classes) and diabetes (regression) datasets.
"""

import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from telemetry import TelemetryConfig, TrainingTelemetry  # noqa: E402

datasets = pytest.importorskip("sklearn.datasets", reason="scikit-learn is a dev extra")


def digits():
    data = datasets.load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    return x, torch.tensor(data.target, dtype=torch.long)


def mlp(out=10):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, out))


def read(run):
    with open(os.path.join(run, "telemetry.jsonl")) as f:
        return [json.loads(line) for line in f]


def manual_eval(model, x, y):
    model.eval()
    with torch.no_grad():
        logits = model(x)
    model.train()
    return logits.argmax(-1).tolist(), (logits.argmax(-1) == y).double().mean().item(), \
        nn.functional.cross_entropy(logits.double(), y).item()


def train_steps(model, optimizer, x, y, steps=3, batch=32):
    for i in range(steps):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x[i * batch:(i + 1) * batch]), y[i * batch:(i + 1) * batch]).backward()
        optimizer.step()


# ---- the holdout: every form it comes in ------------------------------------------------------------


def holdout_forms(x, y):
    pairs = torch.utils.data.TensorDataset(x, y)
    return {
        "DataLoader": torch.utils.data.DataLoader(pairs, batch_size=16),
        "TensorDataset": pairs,
        "list of (x, y) examples": [(x[i], y[i]) for i in range(len(y))],
        "list of (x, int) examples": [(x[i], int(y[i])) for i in range(len(y))],
        "list of batches": [(x[i:i + 20], y[i:i + 20]) for i in range(0, len(y), 20)],
        "one (inputs, labels) batch": (x, y),
        "dict of tensors": {"pixels": x, "label": y},
        "list of per-example dicts": [{"pixels": x[i], "label": int(y[i])} for i in range(len(y))],
    }


@pytest.mark.parametrize("form", list(holdout_forms(torch.zeros(2, 64), torch.zeros(2)).keys()))
def test_every_holdout_form_scores_like_a_manual_eval(tmp_path, form):
    x, y = digits()
    hx, hy = x[-120:], y[-120:]
    model = mlp()

    class DictModel(nn.Module):  # dict batches run model(**batch without the label key)
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, pixels):
            return self.inner(pixels)

    net = DictModel(model) if "dict" in form else model
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    tel = TrainingTelemetry(TelemetryConfig(output_dir=str(tmp_path), collect_every_n=1, strict=True,
                                            holdout_size=50))
    tel.set_holdout_data(holdout_forms(hx, hy)[form])
    train_steps(net, optimizer, x, y, steps=1)
    rec = tel.on_batch_end(net, optimizer, 0, 0)["holdout_logits"]
    tel.close()
    predictions, accuracy, loss = manual_eval(model, hx[:50], hy[:50])
    assert rec["predictions"] == predictions and rec["labels"] == hy[:50].tolist()
    assert rec["accuracy"] == pytest.approx(accuracy, rel=1e-7) and rec["loss"] == pytest.approx(loss, rel=1e-5)
    assert json.loads((tmp_path / "run.json").read_text())["holdout"]["examples"] == 50


def test_unusable_holdouts_are_refused_at_set_holdout_data(tmp_path):
    x, y = digits()
    tel = TrainingTelemetry(TelemetryConfig(output_dir=str(tmp_path), collect_every_n=1))
    with pytest.raises(ValueError, match="labels="):
        tel.set_holdout_data(x[:50])  # a bare tensor: no labels
    with pytest.raises(ValueError, match="batch_label_key, or pass labels="):
        tel.set_holdout_data({"pixels": x[:50], "digit": y[:50]})  # a label key nobody could guess
    with pytest.raises(ValueError, match="cannot be stacked"):
        tel.set_holdout_data([{"input_ids": list(range(n)), "labels": list(range(n))} for n in (5, 7)])
    with pytest.raises(ValueError, match="forward="):
        tel.set_holdout_data([("a caption", y[:4])])
    with pytest.raises(ValueError, match="labels="):
        tel.set_holdout_data([(x[:4], y[:3])])  # one label short
    with pytest.raises(ValueError, match=r"labels of a holdout \(inputs..., labels\) batch are a list, not a tensor"):
        tel.set_holdout_data((x[:50], y[:50].tolist()))
    with pytest.raises(ValueError, match="are a (str|list), not a tensor.*class names mapped to class indices"):
        tel.set_holdout_data([(x[i], "odd" if y[i] % 2 else "even") for i in range(50)])
    multi = (torch.rand(50, 5) > 0.5).float()  # multi-label (BCEWithLogits) targets
    from telemetry import batch_stats
    for targets in (multi, multi.long(), multi.bool()):  # in whatever dtype
        with pytest.raises(ValueError, match=r"labels of shape \[50, 5\] holding only 0 and 1 are multi-label.*"
                                             r"several labels or none, which a class index would misstate"):
            tel.set_holdout_data((x[:50], targets))
        # Nor are a training batch's 0/1 cells counted as if they were classes.
        assert batch_stats((x[:50], targets), None) == {"batch_size": 50, "label_key": "label", "input_elements": 3200,
                                                         "fingerprint": batch_stats((x[:50],), None)["fingerprint"]}
    with pytest.raises(ValueError, match=r"argmax"):
        tel.set_holdout_data((x[:50], nn.functional.one_hot(y[:50], 10).float()))
    tel.set_holdout_data((x[:50], nn.functional.one_hot(y[:50], 10).float()),
                         labels=lambda b: b[-1].argmax(-1))  # one-hot, as the message says: accepted
    tel.set_holdout_data(x[:50], forward=lambda m, b: m(b), labels=lambda b: y[:50])  # said how: accepted
    tel.close()


def test_a_model_that_cannot_take_the_holdout_batch_names_forward(tmp_path):
    """What needs the model is found at the first collection: a dict holdout for a model that takes one
    tensor is an error naming forward= (raised under strict, else recorded and warned about once)."""
    x, y = digits()
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    strict = TrainingTelemetry(TelemetryConfig(output_dir=str(tmp_path / "strict"), collect_every_n=1, strict=True))
    strict.set_holdout_data({"pixels": x[:50], "labels": y[:50]})
    train_steps(model, optimizer, x, y, steps=1)
    with pytest.raises(TypeError, match=r"runs model\(\*\*batch without its label\).*pass forward=lambda model"):
        strict.on_batch_end(model, optimizer, 0, 0)
    strict.close()
    tel = TrainingTelemetry(TelemetryConfig(output_dir=str(tmp_path / "run"), collect_every_n=1))
    tel.set_holdout_data({"pixels": x[:50], "labels": y[:50]})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(3):
            train_steps(model, optimizer, x, y, steps=1)
            rec = tel.on_batch_end(model, optimizer, i, 0)
    tel.close()
    assert "pass forward=" in rec["errors"]["holdout_logits"]
    assert len([w for w in caught if "holdout_logits" in str(w.message)]) == 1
    tel.set_holdout_data({"pixels": x[:50], "labels": y[:50]}, forward=lambda m, b: m(b["pixels"]))  # accepted


def test_holdout_labels_past_the_models_outputs_are_named_before_scoring(tmp_path):
    """A classifier given 9 outputs for the digits' 10 classes (its training labels 9 merged into 8), with a
    holdout that still has class 9: cross_entropy would raise an IndexError on the CPU and, on a GPU, trip a
    device-side assert that ends the process's CUDA context, training included. The labels' range is checked
    against the outputs first: an error naming both (raised under strict, else recorded and warned about once),
    and the same model with labels numbered from 1 is named alike. A model of 10 outputs is scored."""
    x, y = digits()
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 9))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    strict = TrainingTelemetry(TelemetryConfig(output_dir=str(tmp_path / "strict"), collect_every_n=1, strict=True))
    strict.set_holdout_data((x[:50], y[:50]))
    train_steps(model, optimizer, x, y.clamp(max=8), steps=1)
    with pytest.raises(ValueError, match=r"labels run from 0 to 9, but the model gives 9 outputs per example"):
        strict.on_batch_end(model, optimizer, 0, 0)
    strict.close()
    tel = TrainingTelemetry(TelemetryConfig(output_dir=str(tmp_path / "run"), collect_every_n=1))
    tel.set_holdout_data((x[:50], y[:50] + 1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(3):
            train_steps(model, optimizer, x, y.clamp(max=8), steps=1)
            rec = tel.on_batch_end(model, optimizer, i, 0)
    tel.close()
    assert "labels run from 1 to 10" in rec["errors"]["holdout_logits"] and "holdout_logits" not in rec
    assert len([w for w in caught if "holdout_logits" in str(w.message)]) == 1
    wide = mlp()
    optimizer = torch.optim.SGD(wide.parameters(), lr=0.1)
    tel = TrainingTelemetry(TelemetryConfig(output_dir=str(tmp_path / "wide"), collect_every_n=1, strict=True))
    tel.set_holdout_data((x[:50], y[:50]))
    train_steps(wide, optimizer, x, y, steps=1)
    with torch.no_grad():
        want = float((wide(x[:50]).argmax(1) == y[:50]).float().mean())
    assert tel.on_batch_end(wide, optimizer, 0, 0)["holdout_logits"]["accuracy"] == pytest.approx(want)
    tel.close()


class BagOfTokens(nn.Module):
    """A text classifier with an HF model's call: model(input_ids=..., attention_mask=...)."""

    def __init__(self, vocab=50, classes=2):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = nn.Embedding(vocab, 16), nn.Linear(16, classes)

    def forward(self, input_ids, attention_mask):
        mask = attention_mask.unsqueeze(-1).float()
        return self.head((self.embed(input_ids) * mask).sum(1) / mask.sum(1))


def test_a_text_classifiers_dict_batches_count_their_classes(tmp_path):
    """{input_ids [B, T], attention_mask, labels [B]}, as an HF sequence-classification loop gives: one label
    per sequence, so batch_stats counts classes (a language model's [B, T] labels count tokens), and the
    holdout scores like a manual eval."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 50, (256, 12), generator=g)
    labels = (torch.rand(256, generator=g) < 0.1).long()  # 90% class 0: an imbalance to see
    mask = torch.ones_like(ids)
    model = BagOfTokens()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    tel = TrainingTelemetry(TelemetryConfig(output_dir=str(tmp_path), collect_every_n=1, strict=True))
    tel.set_holdout_data({"input_ids": ids[200:], "attention_mask": mask[200:], "labels": labels[200:]})
    batch = {"input_ids": ids[:64], "attention_mask": mask[:64], "labels": labels[:64]}
    loss = nn.functional.cross_entropy(model(ids[:64], mask[:64]), labels[:64])
    loss.backward()
    optimizer.step()
    rec = tel.on_batch_end(model, optimizer, 0, 0, batch=batch, loss=loss)
    tel.close()
    stats = rec["batch_stats"]
    assert stats["counts"] == {str(k): int((labels[:64] == k).sum()) for k in (0, 1)} and stats["label_key"] == "labels"
    model.eval()
    with torch.no_grad():
        logits = model(ids[200:250], mask[200:250])
    assert rec["holdout_logits"]["accuracy"] == pytest.approx((logits.argmax(-1) == labels[200:250]).double().mean().item())


def test_a_one_element_loss_is_a_number_and_a_per_example_loss_is_refused(tmp_path):
    x, y = digits()
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tel = TrainingTelemetry(TelemetryConfig(output_dir=str(tmp_path), collect_every_n=1, strict=True))
    per_example = nn.functional.cross_entropy(model(x[:64]), y[:64], reduction="none")
    per_example.mean().backward()
    optimizer.step()
    with pytest.raises(ValueError, match=r"loss= has 64 values \(shape \[64\]\).*loss.mean\(\)"):
        tel.on_batch_end(model, optimizer, 0, 0, loss=per_example)
    rec = tel.on_batch_end(model, optimizer, 0, 0, loss=per_example.mean().reshape(1))  # DataParallel's [1]
    tel.close()
    assert rec["loss"] == pytest.approx(per_example.double().mean().item(), rel=1e-6)
    assert json.loads((tmp_path / "telemetry.jsonl").read_text().splitlines()[0])["loss"] == rec["loss"]


def test_configured_label_key_is_the_only_one_tried_and_named(tmp_path):
    x, y = digits()
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tel = TrainingTelemetry(TelemetryConfig(output_dir=str(tmp_path), collect_every_n=1, batch_label_key="target"))
    with pytest.raises(ValueError) as refused:
        tel.set_holdout_data({"pixels": x[:8], "label": y[:8]})
    assert "tried target;" in str(refused.value) and "winner" not in str(refused.value)
    tel.close()


def test_shipped_yaml_finds_the_label_of_dict_and_tuple_batches(tmp_path):
    x, y = digits()
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for name, batch in (("dict", {"pixels": x[:64], "label": y[:64]}), ("tuple", (x[:64], y[:64]))):
        tel = TrainingTelemetry(TelemetryConfig.from_yaml(os.path.join(ROOT, "telemetry.yaml"),
                                                          output_dir=str(tmp_path / name), collect_every_n=1))
        train_steps(model, optimizer, x, y, steps=1)
        stats = tel.on_batch_end(model, optimizer, 0, 0, batch=batch)["batch_stats"]
        tel.close()
        counts = torch.bincount(y[:64], minlength=10).tolist()
        assert stats["label_key"] == "label" and stats["batch_size"] == 64
        assert [stats[f"label_{k}_pct"] for k in range(10)] == pytest.approx([100 * c / 64 for c in counts])


# ---- model outputs and task kinds --------------------------------------------------------------------


class FeaturesAndLogits(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(64, 48), nn.ReLU())
        self.head = nn.Linear(48, 10)

    def forward(self, x):
        features = self.body(x)
        return features, self.head(features)


def test_a_tuple_of_tensors_needs_output_and_then_scores_right(tmp_path):
    x, y = digits()
    model = FeaturesAndLogits()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    guessed = TrainingTelemetry(TelemetryConfig(output_dir=str(tmp_path / "guess"), collect_every_n=1))
    guessed.set_holdout_data((x[-50:], y[-50:]))
    for _ in range(2):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x[:64])[1], y[:64]).backward()
        optimizer.step()
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            rec = guessed.on_batch_end(model, optimizer, 0, 0)
    guessed.close()
    # Never a silent guess: no holdout numbers, and an error that names output=.
    assert "holdout_logits" not in rec and "output=" in rec["errors"]["holdout_logits"]
    told = TrainingTelemetry(TelemetryConfig(output_dir=str(tmp_path / "told"), collect_every_n=1, strict=True))
    told.set_holdout_data((x[-50:], y[-50:]), output=1)
    optimizer.step()
    rec = told.on_batch_end(model, optimizer, 0, 0)["holdout_logits"]
    told.close()
    model.eval()
    with torch.no_grad():
        logits = model(x[-50:])[1]
    assert rec["num_classes"] == 10 and rec["predictions"] == logits.argmax(-1).tolist()
    assert rec["accuracy"] == pytest.approx((logits.argmax(-1) == y[-50:]).double().mean().item())


def test_regression_is_recorded_as_regression(tmp_path):
    data = datasets.load_diabetes()
    x = torch.tensor(data.data, dtype=torch.float32)
    t = torch.tensor(data.target, dtype=torch.float32)
    t = (t - t.mean()) / t.std()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    tel = TrainingTelemetry(TelemetryConfig(output_dir=str(tmp_path), collect_every_n=1, strict=True))
    tel.set_holdout_data((x[-50:], t[-50:]))
    for i in range(5):
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x[i * 32:(i + 1) * 32]).squeeze(-1), t[i * 32:(i + 1) * 32]).backward()
        optimizer.step()
        rec = tel.on_batch_end(model, optimizer, i, 0, batch=(x[:32], t[:32]))
    tel.close()
    model.eval()
    with torch.no_grad():
        pred = model(x[-50:]).squeeze(-1).double()
    h = rec["holdout_logits"]
    assert h["kind"] == "regression" and h["outputs"] == 1 and "accuracy" not in h and "num_classes" not in h
    assert h["loss"] == pytest.approx(float((pred - t[-50:].double()).square().mean()), rel=1e-5)
    assert h["mae"] == pytest.approx(float((pred - t[-50:].double()).abs().mean()), rel=1e-5)
    assert h["squared_error"] == pytest.approx((pred - t[-50:].double()).square().tolist(), rel=1e-4, abs=1e-7)
    # No classes in a regression batch: its balance is the batch size only.
    stats = dict(rec["batch_stats"])
    assert stats.pop("fingerprint") == [pytest.approx(x[:32].double().sum().item()),
                                        pytest.approx(x[:32].double().square().sum().item())]
    # None of the batch's first 8 examples is one of the holdout's (the last 50).
    assert stats == {"batch_size": 32, "label_key": "label", "input_elements": x[:32].numel(),
                     "holdout_matches": 0, "holdout_checked": 8, "checked_pairs": 0}


def test_class_indices_stored_as_floats_name_the_cast(tmp_path):
    """Digit classes as floats (0., 1., ..., 9.) are regression targets to the holdout; against a classifier's
    ten outputs the first collection fails with a message that names the cast, which then scores right."""
    x, y = digits()
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tel = TrainingTelemetry(TelemetryConfig(output_dir=str(tmp_path / "a"), collect_every_n=1, strict=True))
    tel.set_holdout_data((x[-50:], y[-50:].float()))
    train_steps(model, optimizer, x, y, steps=1)
    with pytest.raises(ValueError, match=r"class indices stored as floats: pass labels=lambda batch: batch\[-1\]"
                                         r"\.long\(\)"):
        tel.on_batch_end(model, optimizer, 0, 0)
    tel.close()
    tel = TrainingTelemetry(TelemetryConfig(output_dir=str(tmp_path / "b"), collect_every_n=1, strict=True))
    tel.set_holdout_data((x[-50:], y[-50:].float()), labels=lambda batch: batch[-1].long())
    train_steps(model, optimizer, x, y, steps=1)
    record = tel.on_batch_end(model, optimizer, 0, 0)
    tel.close()
    assert record["holdout_logits"]["accuracy"] == pytest.approx(manual_eval(model, x[-50:], y[-50:])[1], rel=1e-7)


# ---- optimizer steps, accumulation, parameters, arguments --------------------------------------------


def accumulating(out, every):
    """The digits, the MLP, its SGD and a strict telemetry collecting every `every` batches, for the tests of
    gradient accumulation."""
    x, y = digits()
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    tel = TrainingTelemetry(TelemetryConfig(output_dir=str(out), collect_every_n=every, strict=True,
                                            alerts=False, track_system=False))
    return x, y, model, optimizer, tel


def micro_batch(model, x, y, batch_idx, accumulate):
    """Backward of micro-batch batch_idx (8 examples), its loss divided by the micro-batches per step."""
    part = slice(batch_idx * 8, batch_idx * 8 + 8)
    (nn.functional.cross_entropy(model(x[part]), y[part]) / accumulate).backward()


def whole_gradient_norm(model):
    return torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()


def test_gradient_accumulation_records_only_whole_gradients(tmp_path):
    x, y, model, optimizer, tel = accumulating(tmp_path, 4)
    accumulate, norms = 4, {}
    for batch_idx in range(1, 45):  # the README's one-liner, called at every micro-batch
        micro_batch(model, x, y, batch_idx, accumulate)
        if batch_idx % accumulate == 0:
            norms[batch_idx] = whole_gradient_norm(model)
            optimizer.step()
        tel.on_batch_end(model, optimizer, batch_idx, 0)
        if batch_idx % accumulate == 0:
            optimizer.zero_grad()
    tel.close()
    records = read(tmp_path)
    # One record per optimizer step whose batch_idx is a multiple of 4: all of them here, and never a
    # micro-batch; `step` counts optimizer steps, batch_idx stays the loop's.
    assert [r["batch_idx"] for r in records] == sorted(norms)
    assert [r["step"] for r in records] == list(range(1, len(norms) + 1))
    for r in records:
        assert r["gradient_norm"]["overall"] == pytest.approx(norms[r["batch_idx"]], rel=1e-6)


def test_gradient_accumulation_with_the_hook_only_after_each_step(tmp_path):
    """The hook called only where the optimizer steps, every 4th batch (batch_idx 3, 7, 11, ...): most multiples
    of collect_every_n=10 fall between two calls of an epoch. Each is collected at the first step after it,
    with that step's whole gradient."""
    x, y, model, optimizer, tel = accumulating(tmp_path, 10)
    accumulate, norms = 4, {}
    for epoch in range(2):
        for batch_idx in range(42):
            micro_batch(model, x, y, batch_idx, accumulate)
            if batch_idx % accumulate == accumulate - 1:
                norms[epoch, batch_idx] = whole_gradient_norm(model)
                optimizer.step()
                tel.on_batch_end(model, optimizer, batch_idx, epoch)
                optimizer.zero_grad()
    tel.close()
    records = read(tmp_path)
    assert [(r["epoch"], r["batch_idx"]) for r in records] == [(e, b) for e in range(2) for b in (11, 23, 31)]
    for r in records:
        assert r["gradient_norm"]["overall"] == pytest.approx(norms[r["epoch"], r["batch_idx"]], rel=1e-6)


def test_optimizers_that_step_on_alternate_batches_are_a_step_at_every_call(tmp_path):
    """Block-coordinate training: the features' optimizer steps on even batches, the head's on odd ones, the
    hook called once per batch with both. Each call follows a step, so every call counts one and collects at
    the multiples of collect_every_n, each record's gradients one backward pass's (they were counted as
    micro-batches: half the steps, and every record said two backward passes)."""
    x, y = digits()
    model = mlp()
    features, head = torch.optim.Adam(model[0].parameters(), 1e-3), torch.optim.Adam(model[2].parameters(), 1e-3)
    tel = TrainingTelemetry(TelemetryConfig(output_dir=str(tmp_path), collect_every_n=5, strict=True))
    norms = {}
    for i in range(40):
        nn.functional.cross_entropy(model(x[32 * i:32 * i + 32]), y[32 * i:32 * i + 32]).backward()
        norms[i + 1] = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()
        (features if i % 2 == 0 else head).step()
        tel.on_batch_end(model, [features, head], i, 0)
        features.zero_grad()
        head.zero_grad()
    tel.close()
    records = read(tmp_path)
    assert [r["step"] for r in records] == list(range(1, 41, 5))
    assert [r["batch_idx"] for r in records] == list(range(0, 40, 5))
    assert all(r.get("accumulation") in (None, 1) for r in records)
    for r in records:
        assert r["gradient_norm"]["overall"] == pytest.approx(norms[r["step"]], rel=1e-5)


def test_several_optimizers_passed_as_a_list_record_each_ones_groups(tmp_path):
    """A backbone's SGD and a head's Adam, each stepping every batch: the records count optimizer steps, hold
    both optimizers' learning rates as they are, and the norms cover every parameter; the analyzer is quiet
    about learning rates and parameters outside the optimizers. Anything else in the list is a TypeError."""
    x, y = digits()
    model = mlp()
    backbone = torch.optim.SGD(model[0].parameters(), lr=0.05)
    head = torch.optim.Adam(model[2].parameters(), lr=0.003)
    scheduler = torch.optim.lr_scheduler.StepLR(head, step_size=5, gamma=0.5)
    run = tmp_path / "run"
    tel = TrainingTelemetry(TelemetryConfig(output_dir=str(run), collect_every_n=4, strict=True))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "in no optimizer group" warning
        expected = {}
        for batch_idx in range(24):
            part = slice(batch_idx * 32 % 1500, batch_idx * 32 % 1500 + 32)
            loss = nn.functional.cross_entropy(model(x[part]), y[part])
            loss.backward()
            backbone.step()
            head.step()
            if batch_idx % 4 == 0:
                before = [p.detach().clone() for p in model.parameters()]
                expected[batch_idx] = (batch_idx + 1, head.param_groups[0]["lr"],
                                       torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item(),
                                       before)
            tel.on_batch_end(model, [backbone, head], batch_idx, 0, loss=loss)
            scheduler.step()
            backbone.zero_grad()
            head.zero_grad()
    tel.close()
    records = read(run)
    assert [r["batch_idx"] for r in records] == sorted(expected)
    previous = None
    for r in records:
        step, head_lr, norm, weights = expected[r["batch_idx"]]
        assert r["step"] == step
        assert r["learning_rates"]["group_0"] == 0.05 and r["learning_rates"]["group_1"] == head_lr
        assert r["gradient_norm"]["overall"] == pytest.approx(norm, rel=1e-6)
        if previous is not None:
            true = math.sqrt(sum(float((a.double() - b.double()).square().sum()) for a, b in zip(weights, previous)))
            assert r["weight_delta"]["overall"] == pytest.approx(true, rel=1e-5)
        previous = weights
    info = json.loads((run / "run.json").read_text())
    assert info["optimizer"] == "SGD+Adam" and "not_in_optimizer" not in info
    import analyze_telemetry as at
    found = at.every_finding(at.diagnose(at.load_run(str(run))))
    assert not {f.code for f in found} & {"lr_zero", "not_in_optimizer", "frozen_parameters"}, found
    with pytest.raises(TypeError, match="a list of optimizers"):
        TrainingTelemetry(TelemetryConfig(output_dir=str(tmp_path / "bad"))).on_batch_end(model, [backbone, "adam"], 0, 0)


def test_optimizers_whose_groups_share_names_keep_each_group_apart(tmp_path):
    """An encoder's and a decoder's AdamW built by one helper, both with groups "decay" and "no_decay": each
    group keeps its own norm and learning rate, the second optimizer's under decay_2 and no_decay_2."""
    x, y = digits()
    model = mlp()

    def adamw(layer, lr):
        return torch.optim.AdamW([{"params": [layer.weight], "name": "decay", "lr": lr},
                                  {"params": [layer.bias], "name": "no_decay", "lr": lr, "weight_decay": 0.0}])
    optimizers = [adamw(model[0], 1e-3), adamw(model[2], 1e-2)]
    tel = TrainingTelemetry(TelemetryConfig(output_dir=str(tmp_path), collect_every_n=1, strict=True))
    for o in optimizers:
        o.zero_grad()
    nn.functional.cross_entropy(model(x[:32]), y[:32]).backward()
    norms = {name: p.grad.norm().item() for name, p in zip(("decay", "no_decay", "decay_2", "no_decay_2"),
                                                             (model[0].weight, model[0].bias, model[2].weight,
                                                              model[2].bias))}
    for o in optimizers:
        o.step()
    rec = tel.on_batch_end(model, optimizers, 0, 0)
    tel.close()
    assert rec["learning_rates"] == {"overall": pytest.approx(1e-2), "decay": pytest.approx(1e-3),
                                     "no_decay": pytest.approx(1e-3), "decay_2": pytest.approx(1e-2),
                                     "no_decay_2": pytest.approx(1e-2)}
    for name, norm in norms.items():
        assert rec["gradient_norm"][name] == pytest.approx(norm, rel=1e-6)


def test_a_batch_in_the_device_slot_is_a_type_error_naming_the_order(tmp_path):
    x, y = digits()
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tel = TrainingTelemetry(TelemetryConfig(output_dir=str(tmp_path), collect_every_n=1))
    train_steps(model, optimizer, x, y, steps=1)
    with pytest.raises(TypeError, match=r"device=None, batch=None.*pass the batch as batch="):
        tel.on_batch_end(model, optimizer, 0, 0, (x[:32], y[:32]))
    tel.close()


def test_a_counter_in_the_device_slot_is_refused_at_the_call(tmp_path):
    # The hook read as (model, optimizer, step, batch_idx, epoch): the epoch lands in device=, an accelerator's
    # index, where the holdout would be sent. On a CPU model every number is refused, naming the order; the
    # loop's own weights are untouched.
    x, y = digits()
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tel = TrainingTelemetry(TelemetryConfig(output_dir=str(tmp_path), collect_every_n=1))
    tel.set_holdout_data((x[-50:], y[-50:]))
    train_steps(model, optimizer, x, y, steps=1)
    kept = [p.detach().clone() for p in model.parameters()]
    for epoch in (0, 3):
        with pytest.raises(ValueError, match=rf"device={epoch} names accelerator {epoch}, but the model is on cpu; "
                                             r"the arguments are \(model, optimizer, batch_idx, epoch, device=None"):
            tel.on_batch_end(model, optimizer, 7, 7, epoch)
    assert all(torch.equal(a, b) for a, b in zip(kept, model.parameters()))
    rec = tel.on_batch_end(model, optimizer, 7, 0, "cpu")   # the device by name is taken
    tel.close()
    assert rec["holdout_logits"]["accuracy"] == pytest.approx(
        (model(x[-50:]).argmax(1) == y[-50:]).float().mean().item())


def test_arguments_that_would_be_recorded_as_something_else_are_refused_at_the_call(tmp_path):
    # A scheduler passed for its optimizer was recorded as one group at lr 0 (and told of a zero learning rate);
    # a loss as text was left out of every loss check; model and optimizer swapped failed section by section.
    import numpy as np

    x, y = digits()
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 10)
    tel = TrainingTelemetry(TelemetryConfig(output_dir=str(tmp_path), collect_every_n=1))
    train_steps(model, optimizer, x, y, steps=1)
    loss = 0.6931
    refused = [((model, scheduler, 0, 0), {}, r"optimizer= got a StepLR, a learning-rate scheduler: pass its optimizer"),
               ((model, [optimizer, scheduler], 0, 0), {}, "optimizer= got a StepLR"),
               ((optimizer, model, 0, 0), {}, r"model= got a SGD, not a torch.nn.Module; the arguments are \(model, "),
               ((model, optimizer, 0, 0), {"loss": "0.5"}, r"loss= got a str; pass the loss the optimizer stepped on"),
               ((model, optimizer, 0, 0), {"loss": [0.5]}, "loss= got a list")]
    for args, kwargs, message in refused:
        with pytest.raises(TypeError, match=message):
            tel.on_batch_end(*args, **kwargs)
    with pytest.raises(TypeError, match="optimizer= got a StepLR"):
        tel.keep_initial_weights(model, scheduler)
    rec = tel.on_batch_end(model, optimizer, 0, 0, loss=np.array(loss, dtype=np.float32))   # numpy's one number
    tel.close()
    assert rec["loss"] == pytest.approx(loss, rel=1e-6) and rec["learning_rates"]["overall"] == pytest.approx(0.1)


def test_disabled_grad_scaler_and_disabled_telemetry_are_quiet(tmp_path):
    x, y = digits()
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", enabled=False)  # the usual enabled=use_amp, without AMP
    tel = TrainingTelemetry(TelemetryConfig(output_dir=str(tmp_path / "on"), collect_every_n=1, strict=True))
    tel.set_grad_scaler(scaler)
    optimizer.zero_grad()
    scaler.scale(nn.functional.cross_entropy(model(x[:32]), y[:32])).backward()
    scaler.step(optimizer)
    scaler.update()
    rec = tel.on_batch_end(model, optimizer, 0, 0)
    tel.close()
    assert "grad_scaler" not in rec and rec["gradient_norm"]["overall"] > 0
    off = TrainingTelemetry(TelemetryConfig(enabled=False, output_dir=str(tmp_path / "off"), collect_every_n=5))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(200):
            optimizer.step()
            assert off.on_batch_end(model, optimizer, 3, 0) is None
    assert not caught and not (tmp_path / "off").exists()


def test_group_pattern_that_matches_nothing_is_named(tmp_path):
    x, y = digits()
    torch.manual_seed(0)
    model = nn.ModuleDict({"body": nn.Linear(64, 32), "head": nn.Linear(32, 10)})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    strict = TrainingTelemetry(TelemetryConfig(output_dir=str(tmp_path / "strict"), collect_every_n=1, strict=True,
                                               groups={"body": ["body"], "head": ["heads.*"]}))
    optimizer.step()
    with pytest.raises(ValueError, match=r"pattern 'heads\.\*' of group 'head' matches no parameter"):
        strict.on_batch_end(model, optimizer, 0, 0)
    strict.close()
    # Not strict: recorded at every collection, without any section read from the parameters, and the
    # analyzer says so first, as critical (a run without gradient norms is no healthy run).
    run = str(tmp_path / "loose")
    loose = TrainingTelemetry(TelemetryConfig(output_dir=run, collect_every_n=1, groups={"head": ["heads.*"]}))
    with pytest.warns(RuntimeWarning, match="matches no parameter"):
        for i in range(3):
            optimizer.step()
            loose.on_batch_end(model, optimizer, i, 0)
    loose.close()
    assert all("gradient_norm" not in r and "layout" in r["errors"] for r in read(run))
    at = pytest.importorskip("analyze_telemetry")
    found = at.diagnose(at.load_run(run, progress=False))
    assert (found[0].code, found[0].severity, found[0].group) == ("section_failed", "critical", "layout")
    with pytest.raises(ValueError, match="groups: 'overall' cannot name a group"):
        TelemetryConfig(groups={"overall": ["head"]})
    with pytest.raises(ValueError, match="groups: group 'head' needs at least one"):
        TelemetryConfig(groups={"head": []})


# ---- restarts --------------------------------------------------------------------------------------


SCRIPT = textwrap.dedent("""
    import sys, torch
    from torch import nn
    from sklearn.datasets import load_digits
    from telemetry import TelemetryConfig, TrainingTelemetry

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target)
    torch.manual_seed(0)
    hidden = int(sys.argv[2]) if len(sys.argv) > 2 else 32
    model = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    telemetry = TrainingTelemetry(TelemetryConfig(output_dir=sys.argv[1], collect_every_n=5))
    telemetry.set_holdout_data(torch.utils.data.TensorDataset(x[-200:], y[-200:]))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x[:-200], y[:-200]), batch_size=32,
                                         shuffle=True, generator=torch.Generator().manual_seed(0))
    for epoch in range(2):
        for batch_idx, (xb, yb) in enumerate(loader):
            logits = model(xb)
            loss = nn.functional.cross_entropy(logits, yb)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            telemetry.on_batch_end(model, optimizer, batch_idx, epoch, batch=(xb, yb), loss=loss,
                                   train_acc=(logits.argmax(-1) == yb).float().mean())
    telemetry.close()
    print(telemetry.output_dir)
""")


def run_user_script(project, *args):
    proc = subprocess.run([sys.executable, "train.py", *args], cwd=project, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc


def test_telemetry_py_copied_alone_into_a_project_and_run_twice(tmp_path):
    """As the README tells a user: telemetry.py alone next to a training script; then the script is run
    again on the same output_dir (a restart), and once with another model (its own directory)."""
    project = tmp_path / "project"
    project.mkdir()
    shutil.copy(os.path.join(ROOT, "telemetry.py"), project)
    (project / "train.py").write_text(SCRIPT)
    run = str(project / "runs" / "exp1")
    run_user_script(project, run)
    first = read(run)
    run_user_script(project, run)
    records = read(run)
    # The second start continues the step count, and its first record says it is a start.
    assert [r.get("start") for r in records] == [0] + [None] * (len(first) - 1) + [1] + [None] * (len(first) - 1)
    assert [r["step"] for r in records] == sorted(r["step"] for r in records) and len(set(r["step"] for r in records)) == len(records)
    assert len(json.loads(open(os.path.join(run, "run.json")).read())["starts"]) == 2
    other = run_user_script(project, run, "48")
    assert other.stdout.strip().endswith("exp1-2") and "holds the run of another model" in other.stderr
    assert len(read(run)) == len(records) and read(run + "-2")[0]["start"] == 0
    # The moved run counts its own steps, from 1, as the first run did with the same loop.
    assert [r["step"] for r in read(run + "-2")] == [r["step"] for r in first]
    # Run again, it resumes there: never a new directory per start.
    again = run_user_script(project, run, "48")
    assert again.stdout.strip().endswith("exp1-2") and "resumes in" in again.stderr
    steps = [r["step"] for r in read(run + "-2")]
    assert len(steps) == 2 * len(first) and steps == sorted(set(steps)) and not os.path.exists(run + "-3")


def test_auto_named_run_directories(tmp_path):
    tel = TrainingTelemetry(TelemetryConfig(output_dir=str(tmp_path / "runs" / "{date}_{host}")))
    assert os.path.isdir(tel.output_dir) and "{" not in tel.output_dir and tel.output_dir.startswith(str(tmp_path))
    tel.close()
    with pytest.raises(ValueError, match="output_dir: .*placeholder"):
        TrainingTelemetry(TelemetryConfig(output_dir=str(tmp_path / "{user}")))


def test_a_float64_model_is_measured_in_float64(tmp_path, pass_threads):
    """A float64 model's gradient norms equal get_total_norm, and its weight deltas equal the distance to
    float64 copies even for updates far below float32's resolution of the weights (lr 1e-7 on weights ~0.1)."""
    x, y = digits()
    x, model = x.double(), mlp().double()
    opt = torch.optim.SGD(model.parameters(), lr=1e-7)
    run = str(tmp_path / "run")
    telemetry = TrainingTelemetry(TelemetryConfig(output_dir=run, collect_every_n=1, track_param_change=True))
    kept, want = [p.detach().clone() for p in model.parameters()], []
    for i in range(4):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x[i * 32:(i + 1) * 32]), y[i * 32:(i + 1) * 32])
        loss.backward()
        opt.step()
        grad = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()
        now = [p.detach().clone() for p in model.parameters()]
        delta = math.sqrt(sum(((a - b) ** 2).sum().item() for a, b in zip(now, kept)))
        want.append((grad, delta, sum((a - b).abs().sum().item() for a, b in zip(now, kept))))
        kept = now
        telemetry.on_batch_end(model, opt, i, 0, batch=(x, y), loss=loss)
    telemetry.close()
    records = read(run)
    assert len(records) == 4 and not any("errors" in r for r in records)
    for r, (grad, _, _) in zip(records, want):
        assert r["gradient_norm"]["overall"] == pytest.approx(grad, rel=1e-6)
    for r, (_, delta, l1) in zip(records[1:], want[1:]):
        assert r["weight_delta"]["overall"] == pytest.approx(delta, rel=1e-5)
        assert r["param_change"]["l1"] == pytest.approx(l1, rel=1e-5)


@pytest.mark.parametrize("wrapper", ["torch.compile", "nn.DataParallel"])
def test_a_run_resumed_with_a_wrapper_is_the_same_run(tmp_path, wrapper):
    """torch.compile(model) names the parameters "_orig_mod.*", nn.DataParallel "module.*": passed to the hook,
    the records still name them as the plain model does, so a run resumed with the wrapper added goes on in
    the same directory and its first delta is measured from the reference the plain run left (against
    float64 copies)."""
    x, y = digits()
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    run = tmp_path / "run"
    kept, want = None, []
    wrapped = torch.compile(model, backend="eager") if wrapper == "torch.compile" else nn.DataParallel(model)
    for phase, hooked in enumerate([model, wrapped]):
        tel = TrainingTelemetry(TelemetryConfig(output_dir=str(run), collect_every_n=1))
        for i in range(3):
            part = slice((phase * 3 + i) * 32, (phase * 3 + i + 1) * 32)
            opt.zero_grad()
            loss = nn.functional.cross_entropy(hooked(x[part]), y[part])
            loss.backward()
            opt.step()
            now = [p.detach().double().clone() for p in model.parameters()]
            want.append((torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item(),
                         None if kept is None else math.sqrt(sum(float((a - b).square().sum())
                                                                 for a, b in zip(now, kept)))))
            kept = now
            tel.on_batch_end(hooked, opt, i, phase, batch=(x[part], y[part]), loss=loss)
        tel.close()
    assert not os.path.exists(f"{run}-2")
    records = read(run)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6] and not any("errors" in r for r in records)
    for r, (norm, delta) in zip(records, want):
        assert r["gradient_norm"]["overall"] == pytest.approx(norm, rel=1e-5)
        if delta is not None:
            assert r["weight_delta"]["overall"] == pytest.approx(delta, rel=1e-5)
    assert set(records[-1]["grad_profile"]) == {"0", "2"}
    info = json.loads((run / "run.json").read_text())
    assert info["groups"]["group_0"]["names"] == ["0.weight", "0.bias", "2.weight", "2.bias"]


def test_group_patterns_on_tied_weights(tmp_path):
    """An LM head tied to the embedding is one tensor, counted once under the embedding's name: grouped by
    that name, its gradient norm is the tied tensor's (both uses summed by autograd); a pattern that names
    only the head's alias is an error that says it is tied, not "matches no parameter"."""
    x, _ = digits()
    ids = (x * 16).round().long()

    class TiedLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(17, 8)
            self.body = nn.Linear(8, 8)
            self.head = nn.Linear(8, 17, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, t):
            return self.head(torch.tanh(self.body(self.emb(t))))

    torch.manual_seed(0)
    model = TiedLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(groups):
        tel = TrainingTelemetry(TelemetryConfig(output_dir=str(tmp_path / "_".join(groups)), collect_every_n=1,
                                                strict=True, groups=groups))
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(ids[:32, :-1]).reshape(-1, 17), ids[:32, 1:].reshape(-1))
        loss.backward()
        opt.step()
        try:
            return tel.on_batch_end(model, opt, 0, 0, loss=loss)
        finally:
            tel.close()

    r = step({"embed": ["emb"], "body": ["body"]})
    assert float(r["gradient_norm"]["embed"]) == pytest.approx(model.emb.weight.grad.norm().item(), rel=1e-6)
    assert float(r["gradient_norm"]["overall"]) == pytest.approx(
        torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item(), rel=1e-6)
    with pytest.raises(ValueError, match=r"'head' matches only tied weights: head\.weight \(tied to emb\.weight\)"):
        step({"embed": ["emb"], "head": ["head"]})


def test_a_language_models_token_batches_are_counted_as_tokens_not_classes(tmp_path):
    """A character-level LM (nanoGPT's (ids, next ids) batches) on the digits' pixel values as tokens, its
    head tied to the embedding: per-token targets follow the text, so the batches are counted as tokens with
    their supervised share, not as 17 classes; the analyzer finds no class imbalance (pixel 0 is half the
    tokens), and the tied weight is counted once in the gradient norm."""
    x, _ = digits()
    tokens = (x * 16).round().long()
    ids, targets = tokens[:, :-1], tokens[:, 1:].clone()
    targets[:, :8] = -100  # a prompt the loss skips

    class TinyLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(17, 16)
            self.body = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
            self.head = nn.Linear(16, 17, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, t):
            return self.head(self.body(self.emb(t)))

    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    run = str(tmp_path / "run")
    tel = TrainingTelemetry(TelemetryConfig(output_dir=run, collect_every_n=1))
    tel.set_holdout_data((ids[-64:], targets[-64:]))
    norms = []
    for i in range(12):
        batch = (ids[i * 32:(i + 1) * 32], targets[i * 32:(i + 1) * 32])
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(batch[0]).reshape(-1, 17), batch[1].reshape(-1))
        loss.backward()
        opt.step()
        norms.append(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item())
        tel.on_batch_end(model, opt, i, 0, batch=batch, loss=loss)
    tel.close()
    records = read(run)
    assert len(records) == 12 and not any("errors" in r for r in records)
    for i, (r, norm) in enumerate(zip(records, norms)):
        labels = targets[i * 32:(i + 1) * 32]
        stats = r["batch_stats"]
        assert "counts" not in stats and stats["batch_size"] == 32 and stats["tokens"] == labels.numel()
        assert stats["label_share"] == pytest.approx((labels != -100).double().mean().item(), rel=1e-6)
        assert r["gradient_norm"]["overall"] == pytest.approx(norm, rel=1e-5)
    assert records[-1]["holdout_logits"]["kind"] == "lm"
    import analyze_telemetry as at
    found = at.every_finding(at.diagnose(at.load_run(run)))
    assert "class_imbalance" not in {f.code for f in found}, found


def test_progressive_unfreezing_keeps_the_drift_of_groups_already_training(tmp_path):
    """A head trained alone, then the body unfrozen and added with optimizer.add_param_group: the head's drift
    still counts from the first call (against float64 copies), the body's from the collection that first holds
    it, and the overall drift adds them up; the delta across the change is null, never a wrong number. The
    unfreeze is the loop's own doing, so nothing is warned; a run resumed in a new process with another set of
    trainable tensors than its files hold is told that its delta and drift restart."""
    x, y = digits()
    model = mlp()
    model[0].requires_grad_(False)
    opt = torch.optim.SGD([{"params": model[2].parameters(), "name": "head"}], lr=0.2, momentum=0.9)
    run = str(tmp_path / "run")
    tel = TrainingTelemetry(TelemetryConfig(output_dir=run, collect_every_n=1))
    start, want = {}, []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(8):
            if i == 4:
                model[0].requires_grad_(True)
                opt.add_param_group({"params": list(model[0].parameters()), "lr": 0.02, "name": "body"})
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x[i * 32:(i + 1) * 32]), y[i * 32:(i + 1) * 32])
            loss.backward()
            opt.step()
            drift = {}
            for group in opt.param_groups:
                sq = 0.0
                for p in group["params"]:
                    w = p.detach().double().clone()
                    sq += float((w - start.setdefault(id(p), w)).square().sum())
                drift[group["name"]] = sq
            want.append(drift)
            tel.on_batch_end(model, opt, i, 0, batch=(x, y), loss=loss)
    tel.close()
    records = read(run)
    assert len(records) == 8 and not any("errors" in r for r in records)
    for r, drift in zip(records, want):
        for group, sq in drift.items():
            assert r["drift"][group] == pytest.approx(math.sqrt(sq), rel=1e-5, abs=1e-7), (r["step"], group)
        assert r["drift"]["overall"] == pytest.approx(math.sqrt(sum(drift.values())), rel=1e-5)
    assert records[4]["weight_delta"]["overall"] is None and records[5]["weight_delta"]["overall"] > 0
    assert records[3]["drift"]["head"] > 0.1  # the head had moved before the body joined
    assert not [str(w.message) for w in caught if "telemetry" in str(w.message)]

    model[0].requires_grad_(False)  # a new process resumes the run with the body frozen again
    opt = torch.optim.SGD([{"params": model[2].parameters(), "name": "head"}], lr=0.2, momentum=0.9)
    with pytest.warns(RuntimeWarning) as caught:
        tel = TrainingTelemetry(TelemetryConfig(output_dir=run, collect_every_n=1))
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x[:32]), y[:32])
        loss.backward()
        opt.step()
        assert tel.on_batch_end(model, opt, 8, 0, batch=(x, y), loss=loss)["weight_delta"]["overall"] is None
        tel.close()
    said = " ".join(str(w.message) for w in caught)
    assert "the delta restarts here" in said and "the drift of tensors it lacks is measured from here" in said


def test_a_gan_calling_the_hook_after_each_optimizer_is_warned(tmp_path):
    """A GAN on the digits: called once per step with both optimizers as a list, each one's group norm is its
    own model's gradient then (get_total_norm) and nothing is warned; called after each optimizer's step in
    turn, the records would alternate between D's and G's groups and never hold a delta: a warning says so,
    once, and the analyzer leads with it. An optimizer rebuilt for good (after unfreezing) is not a turn."""
    x, y = digits()
    bce = nn.functional.binary_cross_entropy_with_logits

    def gan(run, as_list):
        torch.manual_seed(0)
        model = nn.ModuleDict({"G": nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 64), nn.Sigmoid()),
                               "D": nn.Sequential(nn.Linear(64, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))})
        opt_d = torch.optim.Adam(model["D"].parameters(), lr=2e-3, betas=(0.5, 0.999))
        opt_g = torch.optim.Adam(model["G"].parameters(), lr=2e-3, betas=(0.5, 0.999))
        tel = TrainingTelemetry(TelemetryConfig(output_dir=str(tmp_path / run), collect_every_n=1))
        norms = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i in range(6):
                real, fake = x[i * 32:(i + 1) * 32], model["G"](torch.randn(32, 8))
                opt_d.zero_grad()
                loss_d = bce(model["D"](real), torch.ones(32, 1)) + bce(model["D"](fake.detach()), torch.zeros(32, 1))
                loss_d.backward()
                opt_d.step()
                if not as_list:
                    tel.on_batch_end(model, opt_d, i, 0, loss=loss_d)
                opt_g.zero_grad()
                loss_g = bce(model["D"](fake), torch.ones(32, 1))
                loss_g.backward()
                opt_g.step()
                norms.append([torch.nn.utils.get_total_norm([p.grad for p in model[k].parameters()]).item()
                              for k in "DG"])
                tel.on_batch_end(model, [opt_d, opt_g] if as_list else opt_g, i, 0, loss=loss_g)
        tel.close()
        return read(tmp_path / run), norms, [str(w.message) for w in caught if "in turn" in str(w.message)]

    records, norms, turns = gan("list", as_list=True)
    assert not turns and len(records) == 6
    for r, (d, g) in zip(records, norms):
        assert r["gradient_norm"]["group_0"] == pytest.approx(d, rel=1e-5)
        assert r["gradient_norm"]["group_1"] == pytest.approx(g, rel=1e-5)
        assert r["gradient_norm"]["overall"] == pytest.approx(math.hypot(d, g), rel=1e-5)
    assert all(r["weight_delta"]["overall"] > 0 for r in records[1:])
    _, _, turns = gan("in_turn", as_list=False)
    assert len(turns) == 1 and "[opt_a, opt_b]" in turns[0]
    # run.json notes it, and the analyzer puts what the alternating records say (D's tensors in no optimizer
    # at G's calls) under it, where before it named them as the run's problem
    import analyze_telemetry as at
    for run, in_turn in (("list", False), ("in_turn", True)):
        analysed = at.load_run(tmp_path / run, progress=False)
        assert analysed.meta.get("optimizers_in_turn", False) is in_turn
        top = at.diagnose(analysed)
        assert (bool(top) and top[0].code == "optimizers_in_turn") is in_turn, top

    model = mlp()
    tel = TrainingTelemetry(TelemetryConfig(output_dir=str(tmp_path / "rebuilt"), collect_every_n=1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kept = opt = torch.optim.SGD(model[2].parameters(), lr=0.1)
        for i in range(6):
            if i == 3:
                opt = torch.optim.SGD(model.parameters(), lr=0.01)  # `kept` keeps the old one alive
            train_steps(model, opt, x[i * 32:], y[i * 32:], steps=1)
            tel.on_batch_end(model, opt, i, 0)
    tel.close()
    assert kept is not opt and not [w for w in caught if "in turn" in str(w.message)]


def test_a_dataloader_holdout_leaves_a_seeded_run_as_it_was(tmp_path):
    """Iterating a DataLoader draws its base seed from the global RNG, even unshuffled: set_holdout_data with
    one must not shift the training's shuffles and dropout masks. Final weights bit-identical on and off."""
    x, y = digits()
    pairs = torch.utils.data.TensorDataset

    def run(on):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 10))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        tel = None
        if on:
            tel = TrainingTelemetry(TelemetryConfig(output_dir=str(tmp_path / "run"), collect_every_n=2))
            before = torch.get_rng_state()
            tel.set_holdout_data(torch.utils.data.DataLoader(pairs(x[-100:], y[-100:]), batch_size=25))
            assert torch.equal(before, torch.get_rng_state())
        loader = torch.utils.data.DataLoader(pairs(x[:320], y[:320]), batch_size=32, shuffle=True)
        for epoch in range(2):
            for i, (bx, by) in enumerate(loader):
                loss = nn.functional.cross_entropy(model(bx), by)
                loss.backward()
                opt.step()
                if tel is not None:
                    tel.on_batch_end(model, opt, i, epoch, batch=(bx, by), loss=loss)
                opt.zero_grad()
        if tel is not None:
            tel.close()
            assert len(read(str(tmp_path / "run"))) == 10
        return [p.detach().clone() for p in model.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(run(True), run(False)))


def test_an_optimizer_rebuilt_at_a_freed_ones_address_is_read_afresh(tmp_path):
    """Two stages, each with its own optimizer; the first is freed before the second is made, and CPython
    may give the second the first's id() (the test makes optimizers until one gets it). The records'
    learning rates are those of the optimizer that stepped."""
    x, y = digits()
    model = mlp()
    tel = TrainingTelemetry(TelemetryConfig(output_dir=str(tmp_path), collect_every_n=1, strict=True))
    wanted = []

    def stage(opt, epoch):
        for i in range(3):
            loss = nn.functional.cross_entropy(model(x[i * 32:(i + 1) * 32]), y[i * 32:(i + 1) * 32])
            loss.backward()
            opt.step()
            wanted.append(opt.param_groups[0]["lr"])
            tel.on_batch_end(model, opt, i, epoch, loss=loss)
            opt.zero_grad()

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    first = id(opt)
    stage(opt, 0)
    del opt
    kept = []  # optimizers that did not get the address stay alive, so the next one gets another
    for _ in range(2000):
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        if id(opt) == first:
            break
        kept.append(opt)
    else:
        pytest.skip("no new optimizer got the freed one's address")
    kept.clear()
    stage(opt, 1)
    tel.close()
    assert [r["learning_rates"]["group_0"] for r in read(str(tmp_path))] == wanted == [0.1] * 3 + [0.01] * 3


def test_a_taggers_ignored_positions_are_no_class(tmp_path):
    """A frame tagger (each digit's 8 rows as 8 frames of 8 features, a tag per frame, -100 where the loss
    skips padding): batch_stats counts the real tags only, against a bincount of the batch, and says what
    share was ignored."""
    x, _ = digits()
    frames = x.reshape(-1, 8, 8)
    tags = (frames.sum(-1) > 2).long() + (frames.sum(-1) > 4).long()
    tags[::3, 6:] = -100  # every third sequence is two frames shorter
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tel = TrainingTelemetry(TelemetryConfig(output_dir=str(tmp_path), collect_every_n=1, strict=True,
                                            track_holdout_logits=False))
    for i in range(3):
        batch = (frames[i * 30:(i + 1) * 30], tags[i * 30:(i + 1) * 30])
        loss = nn.functional.cross_entropy(model(batch[0]).reshape(-1, 3), batch[1].reshape(-1))
        loss.backward()
        opt.step()
        stats = tel.on_batch_end(model, opt, i, 0, batch=batch, loss=loss)["batch_stats"]
        opt.zero_grad()
        real = batch[1][batch[1] != -100]
        assert stats["counts"] == {str(v): c for v, c in enumerate(torch.bincount(real).tolist()) if c}
        assert stats["ignored_share"] == pytest.approx((batch[1] == -100).double().mean().item())
        assert sum(v for k, v in stats.items() if k.endswith("_pct")) == pytest.approx(100)
    tel.close()


def test_a_list_of_tagged_sequences_is_a_list_of_examples(tmp_path):
    """A tagger's holdout given as a list of (token ids [L], tags [L]) pairs, as list(zip(ids, tags)) of a
    padded dataset makes them: each pair is one example of L positions, stacked like the batch form, not a
    batch of L one-token examples (which scored the padding's -100 tags as wrong: 0.24 for a tagger right
    on 0.99 of the tokens). Against a manual eval() pass over the tagged positions."""
    lines = [ln for ln in open(os.__file__, encoding="utf-8").read().splitlines() if ln.strip()][:120]
    ids = torch.zeros(len(lines), 40, dtype=torch.long)
    tags = torch.full((len(lines), 40), -100)
    for i, ln in enumerate(lines):
        codes = torch.tensor(list(ln.encode()[:40]))
        ids[i, :len(codes)] = codes
        tags[i, :len(codes)] = (codes >= 65).long() + (codes >= 97).long()   # punctuation, capitals, lowercase
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(256, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    for _ in range(30):
        loss = nn.functional.cross_entropy(model(ids[:100]).reshape(-1, 3), tags[:100].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        right = model(ids[100:]).argmax(-1) == tags[100:]
    tagged = tags[100:] != -100
    expected = right[tagged].double().mean().item()
    records = {}
    for form, holdout in {"list": list(zip(ids[100:], tags[100:])), "batch": (ids[100:], tags[100:])}.items():
        tel = TrainingTelemetry(TelemetryConfig(output_dir=str(tmp_path / form), collect_every_n=1, strict=True))
        tel.set_holdout_data(holdout)
        opt.param_groups[0]["lr"] = 0.0   # a step the hook sees, which leaves the weights scored above
        opt.step()
        records[form] = tel.on_batch_end(model, opt, 0, 0)["holdout_logits"]
        tel.close()
    assert records["list"]["accuracy"] == pytest.approx(expected) and expected > 0.9
    assert records["list"]["loss"] == pytest.approx(records["batch"]["loss"])


def test_a_hinge_loss_at_0_is_no_zero_grad_before_the_hook(tmp_path):
    """A hinge loss on iris (setosa against the rest, separable) reaches exactly 0 on a batch whose every
    example clears the margin, and then every gradient is exactly 0: the loss's own doing, not a zero_grad()
    before the hook, and telemetry no longer warns that it is. The warning stays where the loss is not 0."""
    from sklearn.datasets import load_iris
    x, y = load_iris(return_X_y=True)
    x = torch.tensor((x - x.mean(0)) / x.std(0), dtype=torch.float32)
    sign = torch.tensor(y == 0, dtype=torch.float32) * 2 - 1
    said = {}
    for order in ("hook, then zero_grad", "zero_grad, then hook"):
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        tel = TrainingTelemetry(TelemetryConfig(output_dir=str(tmp_path / order[0]), collect_every_n=1,
                                                track_holdout_logits=False))
        zero_losses = 0
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(60):
                idx = torch.arange(step * 16, step * 16 + 16) % 150
                loss = torch.relu(1 - sign[idx] * model(x[idx]).squeeze(1)).mean()
                loss.backward()
                opt.step()
                if order.startswith("zero_grad"):
                    opt.zero_grad(set_to_none=False)   # zeros, where None would be "no gradients"
                tel.on_batch_end(model, opt, step, 0, loss=loss)
                opt.zero_grad()
                zero_losses += int(loss.item() == 0)
        tel.close()
        said[order] = [str(w.message) for w in caught if "every gradient is exactly 0" in str(w.message)]
        assert zero_losses >= 10, zero_losses
    assert said["hook, then zero_grad"] == [] and len(said["zero_grad, then hook"]) == 1


def test_batch_encodings_namedtuples_and_other_batch_objects(tmp_path):
    """transformers' BatchEncoding (a UserDict, not a dict) is read as the dict batch it is, for the holdout
    and batch_stats; a namedtuple holdout is cut to holdout_size and run as model(*inputs); a batch object
    batch_stats cannot read is one warning, not an error in every record. Against manual eval() passes and
    bincounts."""
    transformers = pytest.importorskip("transformers")
    from collections import namedtuple
    x, y = digits()
    Pair = namedtuple("Pair", ["pixels", "label"])

    class DictModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = mlp()

        def forward(self, pixels):
            return self.inner(pixels)

    holdouts = {"BatchEncoding": transformers.BatchEncoding({"pixels": x[-60:], "label": y[-60:]}),
                "list of BatchEncodings": [transformers.BatchEncoding({"pixels": x[i:i + 20], "label": y[i:i + 20]})
                                           for i in range(len(y) - 60, len(y), 20)],
                "namedtuple": Pair(x[-60:], y[-60:])}
    for form, holdout in holdouts.items():
        model = DictModel()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        run = str(tmp_path / form.replace(" ", "_"))
        tel = TrainingTelemetry(TelemetryConfig(output_dir=run, collect_every_n=1, strict=True, holdout_size=50))
        tel.set_holdout_data(holdout)
        batch = transformers.BatchEncoding({"pixels": x[:32], "label": y[:32]})
        loss = nn.functional.cross_entropy(model(batch["pixels"]), batch["label"])
        loss.backward()
        opt.step()
        record = tel.on_batch_end(model, opt, 0, 0, batch=batch, loss=loss)
        tel.close()
        predictions, accuracy, _ = manual_eval(model.inner, x[-60:-10], y[-60:-10])
        assert record["holdout_logits"]["predictions"] == predictions, form
        assert record["holdout_logits"]["accuracy"] == pytest.approx(accuracy, rel=1e-7), form
        assert record["batch_stats"]["counts"] == {str(k): c for k, c in enumerate(torch.bincount(y[:32]).tolist())}

    class Batch:  # a loop's own batch object
        def __init__(self, pixels, label):
            self.pixels, self.label = pixels, label

    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tel = TrainingTelemetry(TelemetryConfig(output_dir=str(tmp_path / "object"), collect_every_n=1))
    with pytest.warns(RuntimeWarning, match="batch= is a Batch, which batch_stats cannot read"):
        for i in range(2):
            batch = Batch(x[i * 32:(i + 1) * 32], y[i * 32:(i + 1) * 32])
            nn.functional.cross_entropy(model(batch.pixels), batch.label).backward()
            opt.step()
            record = tel.on_batch_end(model, opt, i, 0, batch=batch)
            opt.zero_grad()
    tel.close()
    assert "errors" not in record and "batch_stats" not in record


def test_a_weight_tied_after_the_optimizer_was_built_is_named_as_no_longer_held(tmp_path):
    """An output layer's weight tied to the embedding's after the optimizer was built: the optimizer still
    steps the old output weight, which the model no longer holds and no backward reaches. The warning said to
    pass a module that holds it (a ModuleDict with the loss module), which no module can; it now says the
    model no longer holds it, and to build the optimizer after the model is complete. The records are the
    model's tensors' (get_total_norm)."""
    torch.manual_seed(0)
    ids = torch.randint(0, 50, (64, 8))

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.out = nn.Embedding(50, 16), nn.Linear(16, 50, bias=False)

        def forward(self, inputs):
            return self.out(self.embed(inputs))

    model = Tied()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model.out.weight = model.embed.weight
    tel = TrainingTelemetry(TelemetryConfig(output_dir=str(tmp_path), collect_every_n=1))
    with pytest.warns(RuntimeWarning, match=r"steps 1 tensor\(s\) that are not parameters of the model passed to "
                                            r"on_batch_end and have no gradient .*no longer holds"):
        logits = model(ids[:, :-1])
        nn.functional.cross_entropy(logits.reshape(-1, 50), ids[:, 1:].reshape(-1)).backward()
        opt.step()
        want = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()
        record = tel.on_batch_end(model, opt, 0, 0)
    tel.close()
    assert record["gradient_norm"]["overall"] == pytest.approx(want, rel=1e-5)
    assert json.loads((tmp_path / "run.json").read_text())["not_in_model"]["tensors"] == 1


def test_tensors_the_optimizer_steps_outside_the_model_are_named(tmp_path):
    """A learnable temperature and a cosine classifier's prototypes, both outside the model passed to the
    hook, stepped by its optimizer: they cannot be recorded under the model's names, so one warning says
    the norms cover the model's tensors alone and run.json lists them; those norms are right for the model's
    tensors (get_total_norm), and passing a module that holds all of them records every group."""
    x, y = digits()

    def setup():
        torch.manual_seed(0)
        body = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 16))
        prototypes = nn.Linear(16, 10, bias=False)
        temperature = nn.Parameter(torch.tensor(10.0))
        opt = torch.optim.SGD([{"params": list(body.parameters()) + [temperature], "name": "model"},
                               {"params": prototypes.parameters(), "name": "classifier"}], lr=0.1)
        return body, prototypes, temperature, opt

    def loss_of(body, prototypes, temperature, part):
        cos = nn.functional.normalize(body(x[part]), dim=-1) @ nn.functional.normalize(prototypes.weight, dim=-1).T
        return nn.functional.cross_entropy(temperature * cos, y[part])

    body, prototypes, temperature, opt = setup()
    tel = TrainingTelemetry(TelemetryConfig(output_dir=str(tmp_path / "a"), collect_every_n=1))
    with pytest.warns(RuntimeWarning, match=r"steps 2 tensor\(s\) that are not parameters of the model"):
        for i in range(2):
            loss_of(body, prototypes, temperature, slice(i * 32, (i + 1) * 32)).backward()
            opt.step()
            want = torch.nn.utils.get_total_norm([p.grad for p in body.parameters()]).item()
            record = tel.on_batch_end(body, opt, i, 0, loss=None)
            opt.zero_grad()
    tel.close()
    assert record["gradient_norm"]["model"] == pytest.approx(want, rel=1e-5)
    info = json.loads((tmp_path / "a" / "run.json").read_text())
    assert info["not_in_model"] == {"tensors": 2, "elements": 161, "groups": ["classifier", "model"]}

    body, prototypes, temperature, opt = setup()
    whole = nn.ModuleDict({"body": body, "prototypes": prototypes})
    whole.temperature = temperature
    tel = TrainingTelemetry(TelemetryConfig(output_dir=str(tmp_path / "b"), collect_every_n=1, strict=True))
    loss_of(body, prototypes, temperature, slice(0, 32)).backward()
    opt.step()
    want = {g["name"]: torch.nn.utils.get_total_norm([p.grad for p in g["params"]]).item() for g in opt.param_groups}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        record = tel.on_batch_end(whole, opt, 0, 0)
    tel.close()
    assert record["gradient_norm"]["model"] == pytest.approx(want["model"], rel=1e-5)
    assert record["gradient_norm"]["classifier"] == pytest.approx(want["classifier"], rel=1e-5)


def test_a_misspelt_param_group_key_is_named(tmp_path):
    """A head meant to train at 10x, its lr written as "learning_rate", which AdamW never reads: the head
    trains at the base lr, as the records show, and a warning and run.json name the key, the one the
    optimizer reads, and both values. So for a backbone meant to train without weight decay, written as
    Keras names it ("weight_decay_rate"). A scheduler's own key (initial_lr) is not named."""
    x, y = digits()
    model = mlp()
    opt = torch.optim.AdamW([{"params": model[0].parameters(), "name": "backbone", "weight_decay_rate": 0.0},
                             {"params": model[2].parameters(), "name": "head", "learning_rate": 1e-3}], lr=1e-4)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    tel = TrainingTelemetry(TelemetryConfig(output_dir=str(tmp_path), collect_every_n=1))
    with pytest.warns(RuntimeWarning, match=r"group head: learning_rate=0.001 \(it reads lr, which is 0.0001\)"):
        for i in range(2):
            nn.functional.cross_entropy(model(x[i * 32:(i + 1) * 32]), y[i * 32:(i + 1) * 32]).backward()
            opt.step()
            lrs = [g["lr"] for g in opt.param_groups]
            record = tel.on_batch_end(model, opt, i, 0)
            schedule.step()
            opt.zero_grad()
    tel.close()
    assert [record["learning_rates"]["backbone"], record["learning_rates"]["head"]] == pytest.approx(lrs)
    info = json.loads((tmp_path / "run.json").read_text())
    assert info["ignored_group_keys"] == {"backbone": {"weight_decay_rate": [0.0, "weight_decay", 0.01]},
                                          "head": {"learning_rate": [1e-3, "lr", 1e-4]}}


def test_a_layer_left_out_of_the_optimizer_and_the_forward_is_told_it_has_no_gradient(tmp_path):
    """A spare layer that the forward never uses, trainable and in no optimizer group, beside a classifier the
    optimizer trains: the warning said its gradients grow with every backward(), which it has none of. It now
    says the layer has no gradient (unused, or detached), and the records measure the classifier's tensors
    alone (their norm against torch.nn.utils.get_total_norm)."""
    x, y = digits()

    class WithSpare(nn.Module):
        def __init__(self):
            super().__init__()
            self.net, self.spare = mlp(), nn.Linear(8, 8)

        def forward(self, inputs):
            return self.net(inputs)

    model = WithSpare()
    opt = torch.optim.SGD(model.net.parameters(), lr=0.1)
    tel = TrainingTelemetry(TelemetryConfig(output_dir=str(tmp_path), collect_every_n=1))
    with pytest.warns(RuntimeWarning, match=r"in no optimizer group \(spare.weight, spare.bias\) and have no "
                                            r"gradient \(unused in the forward"):
        nn.functional.cross_entropy(model(x[:32]), y[:32]).backward()
        opt.step()
        want = torch.nn.utils.get_total_norm([p.grad for p in model.net.parameters()]).item()
        record = tel.on_batch_end(model, opt, 0, 0)
    tel.close()
    assert record["gradient_norm"]["overall"] == pytest.approx(want, rel=1e-5)
    assert json.loads((tmp_path / "run.json").read_text())["not_in_optimizer"]["gradients"] == 0


def test_complex_parameters_are_named_and_the_real_ones_measured(tmp_path):
    """A complex-valued filter beside a real classifier: the complex tensor is left out with one warning
    (run.json lists it), and every real tensor's norms and deltas are right (get_total_norm, float64
    copies), where before one complex tensor failed gradient_norm and weight_delta for the whole model."""
    x, y = digits()

    class Spectral(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.filter = nn.Parameter(torch.randn(33, dtype=torch.complex64) * 0.1)
            self.head = nn.Linear(64, 10)

        def forward(self, inputs):
            spectrum = torch.fft.rfft(inputs, n=64)
            return self.head(torch.fft.irfft(spectrum * self.filter, n=64))

    model = Spectral()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    tel = TrainingTelemetry(TelemetryConfig(output_dir=str(tmp_path), collect_every_n=1))
    kept, want = None, []
    with pytest.warns(RuntimeWarning, match=r"1 trainable tensor\(s\) are complex \(filter\)"):
        for i in range(3):
            nn.functional.cross_entropy(model(x[i * 32:(i + 1) * 32]), y[i * 32:(i + 1) * 32]).backward()
            opt.step()
            now = [p.detach().double().clone() for p in model.head.parameters()]
            want.append((torch.nn.utils.get_total_norm([p.grad for p in model.head.parameters()]).item(),
                         None if kept is None else math.sqrt(sum(float((a - b).square().sum())
                                                                 for a, b in zip(now, kept)))))
            kept = now
            tel.on_batch_end(model, opt, i, 0)
            opt.zero_grad()
    tel.close()
    records = read(str(tmp_path))
    assert not any("errors" in r for r in records)
    for r, (norm, delta) in zip(records, want):
        assert r["gradient_norm"]["overall"] == pytest.approx(norm, rel=1e-5)
        if delta is not None:
            assert r["weight_delta"]["overall"] == pytest.approx(delta, rel=1e-5)
    info = json.loads((tmp_path / "run.json").read_text())
    assert info["complex"] == {"tensors": 1, "elements": 33, "names": ["filter"]}


def test_keep_initial_weights_before_the_first_step(tmp_path):
    """Without it, W_0 is kept at the hook's first call, after the first step, and drift leaves that step
    out (0 at step 1); with keep_initial_weights before the loop, drift is from the weights the run began
    with. Both against float64 copies."""
    x, y = digits()
    for keep in (False, True):
        model = mlp()
        opt = torch.optim.Adam(model.parameters(), lr=3e-3)
        tel = TrainingTelemetry(TelemetryConfig(output_dir=str(tmp_path / str(keep)), collect_every_n=2))
        copies = [[p.detach().double().clone() for p in model.parameters()]]
        if keep:
            tel.keep_initial_weights(model, opt)
        for i in range(5):
            nn.functional.cross_entropy(model(x[i * 32:(i + 1) * 32]), y[i * 32:(i + 1) * 32]).backward()
            opt.step()
            copies.append([p.detach().double().clone() for p in model.parameters()])
            tel.on_batch_end(model, opt, i, 0)
            opt.zero_grad()
        tel.close()
        base = copies[0] if keep else copies[1]
        for r in read(str(tmp_path / str(keep))):
            want = math.sqrt(sum(float((a - b).square().sum()) for a, b in zip(copies[r["step"]], base)))
            assert r["drift"]["overall"] == pytest.approx(want, rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_a_model_in_another_dtype_runs_the_holdout_in_it(tmp_path, dtype):
    """A model turned to bf16 before training, or to float64 mid-run, given a float32 holdout: its inputs
    run in the model's dtype (as the loop's own do), its labels stay as they are, and every collection
    scores like an eval() pass on inputs cast the same way, where before each one failed."""
    x, y = digits()
    model = mlp()
    if dtype == torch.bfloat16:
        model = model.to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tel = TrainingTelemetry(TelemetryConfig(output_dir=str(tmp_path), collect_every_n=1, strict=True))
    tel.set_holdout_data((x[-50:], y[-50:]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # float64 mid-run: the references no longer match
        for i in range(4):
            if i == 2 and dtype == torch.float64:
                model = model.to(dtype)
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
            inputs = x[i * 32:(i + 1) * 32].to(next(model.parameters()).dtype)
            nn.functional.cross_entropy(model(inputs).float(), y[i * 32:(i + 1) * 32]).backward()
            opt.step()
            record = tel.on_batch_end(model, opt, i, 0)
            opt.zero_grad()
            model.eval()
            with torch.no_grad():
                logits = model(x[-50:].to(next(model.parameters()).dtype)).double()
            model.train()
            assert record["holdout_logits"]["predictions"] == logits.argmax(-1).tolist()
            assert record["holdout_logits"]["loss"] == pytest.approx(
                nn.functional.cross_entropy(logits, y[-50:]).item(), rel=1e-5)
    tel.close()
