"""The analyzer's diagnosis on small real training runs (scikit-learn's 8x8 digits, tiny models, telemetry.py
recording): each check fires on a run where its problem is planted, as the first loud finding or under the
cause it follows from, and keeps quiet on healthy runs. Numbers in the messages are checked against the
records or the model where they can be.
"""

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import analyze_telemetry as at  # noqa: E402
from telemetry import TelemetryConfig, TrainingTelemetry  # noqa: E402

LOUD = ("warning", "critical")


@pytest.fixture(scope="module")
def digits():
    from sklearn.datasets import load_digits

    d = load_digits()
    return torch.tensor(d.data / 16.0, dtype=torch.float32), torch.tensor(d.target)


def mlp(hidden=(64,), act=nn.ReLU, n_in=64, n_out=10):
    layers, width = [], n_in
    for h in hidden:
        layers += [nn.Linear(width, h), act()]
        width = h
    return nn.Sequential(*layers, nn.Linear(width, n_out))


def train(out, data, model, steps=120, lr=0.05, opt="sgd", every=4, batch=32, groups=None, order=None,
          labels=None, n_train=600, train_acc=True, after_optimizer=None, batch_hook=None, holdout=None):
    """A plain loop on the digits with telemetry: the first n_train examples train, the next 100 are the
    holdout (or `holdout`, an (inputs, labels) pair). `order(step, rng)` gives a batch's indices (default: a
    fresh shuffle each epoch), `labels` replaces the train labels, `groups(model)` makes the optimizer's param
    groups, `after_optimizer(model)` runs once the optimizer is built, `batch_hook(step, x)` may change a
    batch's inputs."""
    x, y = data
    y_train = (labels if labels is not None else y)[:n_train]
    torch.manual_seed(0)
    rng = np.random.RandomState(0)
    params = groups(model) if groups else model.parameters()
    optimizer = (torch.optim.SGD(params, lr=lr, momentum=0.9) if opt == "sgd"
                 else torch.optim.Adam(params, lr=lr))
    if after_optimizer:
        after_optimizer(model)
    tel = TrainingTelemetry(TelemetryConfig(output_dir=str(out), collect_every_n=every, holdout_size=100))
    tel.set_holdout_data(holdout if holdout is not None else (x[n_train:n_train + 100], y[n_train:n_train + 100]))
    per_epoch = n_train // batch
    perm = None
    for step in range(1, steps + 1):
        if order:
            idx = order(step, rng)
        else:
            if (step - 1) % per_epoch == 0:
                perm = rng.permutation(n_train)
            k = (step - 1) % per_epoch
            idx = perm[k * batch:(k + 1) * batch]
        xb, yb = x[idx], y_train[idx]
        if batch_hook:
            xb = batch_hook(step, xb)
        out_ = model(xb)
        loss = F.cross_entropy(out_, yb)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scalars = {"train_acc": (out_.argmax(1) == yb).float().mean()} if train_acc else {}
        tel.on_batch_end(model, optimizer, step, (step - 1) // per_epoch, batch=(xb, yb), loss=loss, **scalars)
    tel.close()
    return Path(out)


def diagnosis(path):
    run = at.load_run(path, progress=False)
    found = at.diagnose(run)
    assert not [n for n in run.notices if at.CHECK_FAILED in n], run.notices
    return run, found


def loud(found):
    return [f for f in found if f.severity in LOUD]


def first_loud(path):
    _, found = diagnosis(path)
    top = loud(found)
    assert top, [(f.code, f.severity) for f in found]
    return top[0], found


def everything(found):
    return {f.code: f for f in reversed(at.every_finding(found))}


def two_groups(model):
    return [{"params": list(model[:-1].parameters()), "name": "backbone"},
            {"params": list(model[-1].parameters()), "lr": 0.5, "name": "head"}]


@pytest.fixture(scope="module")
def healthy(tmp_path_factory, digits):
    """A healthy two-group run (the head at 10x the backbone's learning rate)."""
    return train(tmp_path_factory.mktemp("healthy") / "run", digits, mlp(), groups=two_groups)


def test_a_healthy_run_is_quiet_and_shows_each_groups_rate(healthy):
    run, found = diagnosis(healthy)
    assert not loud(found), [(f.code, f.message) for f in loud(found)]
    rates = {r["group"]: r for r in at.summarize(run, found)["group_rates"]}
    records = [json.loads(line) for line in (healthy / "telemetry.jsonl").read_text().splitlines()]
    head_ur = np.median([r["update_ratio"]["head"] for r in records[1:]])
    back_ur = np.median([r["update_ratio"]["backbone"] for r in records[1:]])
    assert rates["head"]["lr"] == 0.5 and rates["backbone"]["lr"] == 0.05 and rates["head"]["lr_x"] == pytest.approx(10)
    assert rates["head"]["update_ratio"] == pytest.approx(head_ur)
    small = min(head_ur, back_ur)
    assert rates["head"]["update_ratio_x"] == pytest.approx(head_ur / small)
    assert "learning rate per group" in at.format_text([(run, found, at.summarize(run, found))])


def test_frozen_parameters(tmp_path, digits):
    # the backbone frozen after the optimizer was built: its group keeps lr 0.05
    top, _ = first_loud(train(tmp_path / "r", digits, mlp(), groups=two_groups,
                              after_optimizer=lambda m: m[:-1].requires_grad_(False)))
    assert (top.code, top.severity, top.group) == ("frozen_parameters", "critical", "backbone")
    assert "learning rate 0.05" in top.message and "all of its tensors (4,160 weights" in top.message


@pytest.mark.filterwarnings("ignore:telemetry. 2 trainable tensor")
def test_not_in_optimizer(tmp_path, digits):
    model = mlp(hidden=(64, 32))
    path = train(tmp_path / "r", digits, model, groups=lambda m: list(m[0].parameters()) + list(m[4].parameters()))
    top, _ = first_loud(path)
    assert (top.code, top.severity) == ("not_in_optimizer", "warning")
    assert "2 trainable tensor(s) (2,080 weights: 2.weight, 2.bias)" in top.message


def test_holdout_below_chance_with_shifted_labels(tmp_path, digits):
    # every class relabelled as the next one: the holdout (true labels) lands below chance, not in the band
    top, found = first_loud(train(tmp_path / "r", digits, mlp(), labels=(digits[1] + 1) % 10, steps=150, opt="adam",
                                  lr=3e-3))
    assert (top.code, top.severity) == ("holdout_below_chance", "critical")
    assert "below chance 0.100" in top.message and "line up with the inputs" in top.hint
    assert "overfitting" not in {f.code for f in loud(found)}   # the holdout's rise is its consequence


def test_stalled_loss_on_random_labels_sits_under_the_holdout_at_chance(tmp_path, digits):
    shuffled = digits[1][torch.from_numpy(np.random.RandomState(1).permutation(len(digits[1])))]
    top, found = first_loud(train(tmp_path / "r", digits, mlp(), labels=shuffled, lr=0.01))
    assert top.code == "holdout_at_chance"
    assert "loss_stalled" in {c.code for c in top.consequences}
    forgetting = everything(found).get("forgetting")
    assert forgetting is None or forgetting.severity == "info"   # nothing was learned, so nothing forgotten


def test_loss_diverging_takes_its_echoes_under_it(tmp_path, digits, capsys):
    path = train(tmp_path / "r", digits, mlp(), lr=2.0, opt="sgd", steps=80)
    top, found = first_loud(path)
    assert top.code == "loss_diverging", [(f.code, f.message) for f in found]
    under = {c.code for c in top.consequences}
    assert {"dead_units", "holdout_at_chance"} <= under
    assert [f.code for f in found if f.code in ("dead_units", "holdout_at_chance")] == []
    assert top.severity == "critical"   # it takes the holdout at chance's severity: --check still fails
    assert at.main([str(path), "--json", "--check"]) == 1
    first = json.loads(capsys.readouterr().out)["findings"][0]
    assert first["code"] == "loss_diverging" and {"dead_units", "holdout_at_chance"} <= {
        c["code"] for c in first["consequences"]}
    at.main([str(path), "--no-plots"])
    text = capsys.readouterr().out
    assert "  CRITICAL loss_diverging: " in text and "follows from it:" in text
    assert "             CRITICAL holdout_at_chance: " in text   # indented under its cause


def test_loss_oscillating(tmp_path, digits):
    top, found = first_loud(train(tmp_path / "r", digits, mlp(), lr=0.5, opt="sgd", steps=150, every=5))
    assert top.code == "loss_oscillating", [(f.code, f.message) for f in found]
    h = at.holdout_data(at.load_run(tmp_path / "r", progress=False))
    d = np.diff(h.loss[len(h.loss) // 2:])
    swings = np.abs(d - np.median(d))   # around the half's own drift: a steady climb is no swing
    assert f"median {at._fmt(float(np.median(swings)))}" in top.message


def test_not_learning_with_a_learning_rate_far_too_low(tmp_path, digits):
    top, found = first_loud(train(tmp_path / "r", digits, mlp(), lr=1e-6, opt="sgd"))
    assert (top.code, top.severity) == ("not_learning", "critical")
    assert "holdout_at_chance" in {c.code for c in top.consequences}


def test_dead_units(tmp_path, digits):
    def dead_init(model):
        with torch.no_grad():
            model[0].bias.fill_(-5.0)   # no input of the digits (pixels in 0..1) lifts them above 0

    model = mlp(hidden=(64,))
    dead_init(model)
    top, _ = first_loud(train(tmp_path / "r", digits, model, opt="adam", lr=1e-3))
    assert (top.code, top.group) == ("dead_units", "1")
    with torch.no_grad():
        fired = (model[1](model[0](digits[0][600:700])) > 0).any(0).float().mean().item()
    assert f"{1 - fired:.0%} dead" in top.message and "dead already at the first collection" in top.message


def test_saturated_units_and_a_healthy_tanh_net(tmp_path, digits):
    model = mlp(hidden=(64, 64), act=nn.Tanh)
    with torch.no_grad():
        for m in model:
            if isinstance(m, nn.Linear) and m.out_features == 64:
                m.weight.mul_(10.0)
    top, _ = first_loud(train(tmp_path / "sat", digits, model, lr=0.01))
    assert top.code == "saturated_units"
    _, found = diagnosis(train(tmp_path / "ok", digits, mlp(hidden=(64, 64), act=nn.Tanh), lr=0.05))
    assert not loud(found), [(f.code, f.message) for f in loud(found)]


def test_vanishing_gradients_from_the_gradient_profile(tmp_path, digits):
    path = train(tmp_path / "r", digits, mlp(hidden=(32,) * 10, act=nn.Sigmoid), lr=0.05, steps=60)
    top, _ = first_loud(path)
    assert (top.code, top.group) == ("vanishing_gradients", "0")
    records = [json.loads(line) for line in (path / "telemetry.jsonl").read_text().splitlines()]
    half = records[len(records) // 2:]
    ratios = [math.hypot(*(r["grad_profile"][k] for k in ("0", "2"))) /
              math.hypot(*(r["grad_profile"][k] for k in ("18", "20"))) for r in half]
    assert f"get {at._fmt(float(np.median(ratios)))} of the gradient norm" in top.message


def test_repeated_batches_and_full_batch_training(tmp_path, digits):
    same = np.arange(32)
    top, _ = first_loud(train(tmp_path / "r", digits, mlp(), order=lambda step, rng: same, opt="adam", lr=1e-3))
    assert top.code == "repeated_batches" and "only 1 distinct batch" in top.message
    # the whole train set as one batch: the same batch every step, but each step is an epoch of its own
    path = train(tmp_path / "full", digits, mlp(), n_train=64, batch=64, steps=40, opt="adam", lr=1e-3)
    _, found = diagnosis(path)
    assert "repeated_batches" not in everything(found)
    # batches of one example drawn with replacement (an index per step): 100 collections from 600 examples
    # meet the same example again by chance, never twice in a row here; one example stuck is named
    path = train(tmp_path / "drawn", digits, mlp(), batch=1, steps=400, opt="adam", lr=1e-3,
                 order=lambda step, rng: rng.randint(0, 600, 1))
    prints = [tuple(r["batch_stats"]["fingerprint"]) for r in map(json.loads, (path / "telemetry.jsonl").open())]
    assert len(prints) - len(set(prints)) >= 2
    _, found = diagnosis(path)
    assert "repeated_batches" not in everything(found)
    top, _ = first_loud(train(tmp_path / "stuck", digits, mlp(), batch=1, steps=400, opt="adam", lr=1e-3,
                              order=lambda step, rng: np.array([5])))
    assert top.code == "repeated_batches" and "only 1 distinct batch" in top.message


def test_labels_of_batches_of_one_uneven_by_chance_are_no_imbalance(tmp_path, digits):
    """Batches of one drawn uniformly (an index per step) from 600 digits and collected every 20 steps: 40
    labels, of which 12 (30%) are 7s where the holdout has 9% and the train set 10%. Among 10 classes one
    is that far off by chance now and then, so the 3-sigma threshold is shared among the classes. A sampler
    that draws the 7s 4x as often as the rest is still named, with its 200 labels collected every 4 steps."""
    x, y = digits
    drawn = np.random.RandomState(346).randint(0, 600, 800)
    assert (y[drawn[19::20]] == 7).sum().item() == 12 and abs((y[:600] == 7).float().mean().item() - 0.1) < 0.01
    path = train(tmp_path / "drawn", digits, mlp(), batch=1, steps=800, every=20, opt="adam", lr=1e-3,
                 order=lambda step, rng: drawn[step - 1:step], holdout=(x[700:800], y[700:800]))
    _, found = diagnosis(path)
    assert "class_imbalance" not in everything(found), everything(found)["class_imbalance"].message
    weights = np.where(y[:600].numpy() == 7, 4.0, 1.0)
    sevens = np.random.RandomState(0).choice(600, 800, p=weights / weights.sum())
    path = train(tmp_path / "sevens", digits, mlp(), batch=1, steps=800, every=4, opt="adam", lr=1e-3,
                 order=lambda step, rng: sevens[step - 1:step], holdout=(x[700:800], y[700:800]))
    _, found = diagnosis(path)
    assert "class 7" in everything(found)["class_imbalance"].message


def test_unshuffled_batches(tmp_path, digits):
    order = np.argsort(digits[1][:600].numpy(), kind="stable")
    top, _ = first_loud(train(tmp_path / "r", digits, mlp(), order=lambda step, rng: order[
        ((step - 1) % 18) * 32:((step - 1) % 18 + 1) * 32], lr=0.05))
    assert top.code == "unshuffled_batches"
    assert "random batches of that size from these class shares would hold 9." in top.message


def test_a_bad_batch_leads_with_its_loss_spike(tmp_path, digits):
    path = train(tmp_path / "r", digits, mlp(), opt="adam", lr=1e-3, steps=160,
                 batch_hook=lambda step, x: x * 1000 if step == 80 else x)
    top, found = first_loud(path)
    assert top.code == "loss_spike" and 80 in top.steps
    assert all(f.code not in ("exploding_gradients", "grad_explosion", "grad_spike") for f in found)
    assert "exploding_gradients" in {c.code for c in top.consequences}


def test_overfitting_verdict_does_not_depend_on_train_accuracy(tmp_path, digits):
    # 30 examples, a wide MLP, full batches: the holdout loss climbs while the train loss goes to 0
    kwargs = dict(n_train=30, batch=30, steps=200, every=4, opt="adam", lr=3e-3)
    with_acc = train(tmp_path / "a", digits, mlp(hidden=(256, 256)), **kwargs)
    without = train(tmp_path / "b", digits, mlp(hidden=(256, 256)), train_acc=False, **kwargs)
    verdicts = []
    for path in (with_acc, without):
        codes_ = everything(diagnosis(path)[1])
        verdicts.append(("overfitting" in codes_, codes_.get("overfitting")))
    assert verdicts[0][0] and verdicts[1][0]
    assert "train accuracy" in verdicts[0][1].message and "train accuracy" not in verdicts[1][1].message


def test_a_small_holdouts_noise_at_every_step_is_not_overfitting(tmp_path):
    """SGD with momentum, collecting at every step, a 50-example holdout: its loss swings 1.6x as a few
    examples turn confidently wrong and back, while on 20,000 fresh examples of the same problem the loss
    stays within 1.1x of its best and accuracy ends at 0.95. Paired per example (t of the loss change,
    McNemar for accuracy), that swing is the holdout's sampling noise: no overfitting. The labels come from
    a fixed linear teacher, so fresh examples are unlimited."""
    torch.manual_seed(0)
    x, teacher = torch.randn(4000, 20), torch.randn(20, 4)
    y = (x @ teacher).argmax(1)
    fresh = torch.randn(20000, 20, generator=torch.Generator().manual_seed(123))
    fresh_y = (fresh @ teacher).argmax(1)
    model = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    tel = TrainingTelemetry(TelemetryConfig(output_dir=str(tmp_path), collect_every_n=1))
    tel.set_holdout_data((x[-200:], y[-200:]))
    fresh_loss = []
    for step in range(300):
        idx = torch.randint(0, 3500, (32,))
        loss = F.cross_entropy(model(x[idx]), y[idx])
        loss.backward()
        optimizer.step()
        tel.on_batch_end(model, optimizer, step % 100, step // 100, batch=(x[idx], y[idx]), loss=loss)
        optimizer.zero_grad()
        with torch.no_grad():
            fresh_loss.append(F.cross_entropy(model(fresh), fresh_y).item())
    tel.close()
    with torch.no_grad():
        assert (model(fresh).argmax(1) == fresh_y).float().mean() > 0.93
    assert np.median(fresh_loss[-3:]) < 1.2 * min(fresh_loss)   # healthy by the corpus's definition
    run, found = diagnosis(tmp_path)
    h = at.holdout_data(run)
    assert h.loss[-3:].min() > 1.3 * h.loss.min()   # the 50 examples alone would say otherwise
    assert not loud(found), [(f.code, f.message) for f in loud(found)]


def test_class_imbalance_names_the_labels(tmp_path, digits):
    y = digits[1][:600].numpy()
    pool = np.flatnonzero(y >= 3)   # classes 0-2 never drawn

    def order(step, rng):
        return rng.choice(pool, 32)
    top, _ = first_loud(train(tmp_path / "r", digits, mlp(), order=order, lr=0.05))
    assert top.code == "class_imbalance"
    assert "class 0: 0.0%" in top.message and "class 9:" in top.message


def test_nonfinite_names_the_loss_first(tmp_path, digits):
    def nan_once(step, x):
        if step == 61:
            x = x.clone()
            x[0, 0] = float("nan")
        return x
    top, _ = first_loud(train(tmp_path / "r", digits, mlp(), batch_hook=nan_once, steps=80))
    assert top.code == "nonfinite" and "in loss;" in top.message
    assert "holdout_at_chance" in {c.code for c in top.consequences}


def test_an_imbalance_the_holdout_shares_explains_nothing_about_the_holdout(tmp_path, digits):
    """Classes 5-9 at a quarter of their share in train batches and in the holdout alike: the imbalance is
    real, but a holdout at chance (its labels shuffled) and its rising loss are not its doing, so they stand
    as their own root; and the rare classes' recall on shuffled labels (0% of 18 against 15% of 82, 1.7
    sigmas apart) is no evidence of harm, so no class_imbalance is told. Train batches of classes 0-2
    against a holdout of all ten: the imbalance leads, and the holdout's loss, rising from an untrained
    model's, is no overfitting of its own (stopping at that best keeps an untrained model)."""
    x, y = digits
    keep = (y < 5).numpy() | (np.random.RandomState(3).rand(len(y)) < 0.25)
    pool = np.flatnonzero(keep[:600])
    rest = np.flatnonzero(keep[600:])[:100] + 600
    shuffled = y[rest][torch.from_numpy(np.random.RandomState(9).permutation(len(rest)))]
    path = train(tmp_path / "same", digits, mlp(), order=lambda step, rng: rng.choice(pool, 32), opt="adam", lr=3e-3,
                 holdout=(x[rest], shuffled))
    _, found = diagnosis(path)
    top = {f.code: f for f in found}
    assert "class_imbalance" not in everything(found)
    assert top["holdout_at_chance"].severity == "critical"
    assert "overfitting" in {c.code for c in top["holdout_at_chance"].consequences}
    json_finding = at.findings_json([(at.load_run(path, progress=False), found, {})])["findings"][0]
    assert "explains_only" not in json_finding

    few = np.flatnonzero(y[:600].numpy() < 3)
    path = train(tmp_path / "apart", digits, mlp(), order=lambda step, rng: rng.choice(few, 32), opt="adam", lr=3e-3)
    top, found = first_loud(path)
    assert top.code == "class_imbalance" and "of the holdout" in top.message
    assert "overfitting" not in {f.code for f in found if f is not top}, [(f.code, f.message) for f in found]


class Detached(nn.Module):
    """A backbone and a head in one optimizer group, the backbone's output detached before the head."""

    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.head = nn.Linear(64, 10)

    def forward(self, x):
        return self.head(self.backbone(x).detach())


class TakingTurns(nn.Module):
    """Two heads on one backbone, trained on alternate batches (two tasks): each head has no gradient on
    every other step."""

    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(64, 64), nn.ReLU())
        self.heads = nn.ModuleList([nn.Linear(64, 10), nn.Linear(64, 10)])
        self.calls = 0

    def forward(self, x):
        if self.training:
            self.calls += 1
        return self.heads[self.calls % 2 if self.training else 0](self.backbone(x))


def test_a_detached_backbone_that_never_gets_a_gradient(tmp_path, digits):
    model = Detached()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    path = train(tmp_path / "r", digits, model, opt="adam", lr=1e-2, steps=80)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items() if k.startswith("backbone"))
    top, _ = first_loud(path)
    records = [json.loads(line) for line in (path / "telemetry.jsonl").read_text().splitlines()]
    assert (top.code, top.severity) == ("frozen_group", "critical")
    assert f"2 layer(s) (backbone.0, backbone.2) got no gradient at all (null in the gradient profile) in all " \
           f"{len(records)} collections" in top.message and "detach()" in top.hint
    # heads that take turns have no gradient on every other step only: no finding
    path = train(tmp_path / "turns", digits, TakingTurns(), opt="adam", lr=1e-3, steps=60, every=3)
    nulls = [r["grad_profile"]["heads.1"] is None for r in json.loads(
        "[" + ",".join((path / "telemetry.jsonl").read_text().splitlines()) + "]")]
    assert any(nulls) and not all(nulls)
    _, found = diagnosis(path)
    assert "frozen_group" not in everything(found), [(f.code, f.message) for f in found]
    # collected at every even step, one head is never seen with a gradient: still no finding, since the
    # records cannot tell it from a head the loss never reaches (only the input side counts)
    path = train(tmp_path / "even", digits, TakingTurns(), opt="adam", lr=1e-3, steps=60, every=2)
    assert all(json.loads(line)["grad_profile"]["heads.1"] is None
               for line in (path / "telemetry.jsonl").read_text().splitlines())
    _, found = diagnosis(path)
    assert "frozen_group" not in everything(found), [(f.code, f.message) for f in found]


def test_heads_taking_turns_show_the_update_ratio_of_their_own_steps(tmp_path, digits):
    """Each head of a two-task loop moves at every other step: the summary's update ratio per group is that of
    the steps where the group had a gradient, not a median half made of its idle steps' zeros."""
    def groups(m):
        return [{"params": m.backbone.parameters(), "name": "backbone"},
                {"params": m.heads[0].parameters(), "name": "head0"},
                {"params": m.heads[1].parameters(), "name": "head1"}]
    path = train(tmp_path / "r", digits, TakingTurns(), opt="sgd", lr=0.05, steps=40, every=1, groups=groups)
    rates = {r["group"]: r["update_ratio"] for r in at.group_rates(at.load_run(path, progress=False))}
    records = [json.loads(line) for line in (path / "telemetry.jsonl").read_text().splitlines()]
    for head in ("head0", "head1"):
        moved = [r["update_ratio"][head] for r in records[1:] if r["gradient_norm"][head] is not None]
        assert 0 < min(moved) and rates[head] == pytest.approx(float(np.median(moved)))


def test_a_bad_batch_that_ruins_the_weights_is_not_a_learning_rate_too_high(tmp_path, digits):
    """One batch of inputs x50 under SGD with momentum: the loss spikes at that batch and never comes back (the
    ReLUs die). The batch is the cause, listed first with the gradient jump under it; not a divergence, not
    a loss stalled from the start, not overfitting (the train loss rose too)."""
    path = train(tmp_path / "r", digits, mlp(hidden=(64, 64)), lr=0.05, every=1, steps=108,
                 batch_hook=lambda step, x: x * 50 if step == 61 else x)
    top, found = first_loud(path)
    assert top.code == "loss_spike" and 61 in top.steps, [(f.code, f.message) for f in found]
    assert "The batch of step 61 was bad, not the weights" in top.message
    assert "did not come back" in top.message
    assert "exploding_gradients" in {c.code for c in top.consequences}
    codes = everything(found)
    assert not {"loss_diverging", "loss_stalled", "overfitting"} & set(codes), [(f.code, f.message) for f in found]
    # the same run without the bad batch is quiet
    _, found = diagnosis(train(tmp_path / "clean", digits, mlp(hidden=(64, 64)), lr=0.05, every=1, steps=108))
    assert not loud(found), [(f.code, f.message) for f in loud(found)]
