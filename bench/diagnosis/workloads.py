"""The training runs of the diagnosis corpus: data, models, one loop per kind of run, the planted problems,
and the checks that prove each label (healthy, or the planted problem) is true.

Every run splits its data three ways: train, the holdout telemetry gets (50-100 examples), and a test set
that telemetry never sees (the rest). Labels are verified on the test set or by a measurement the loop makes
itself (weights compared with a copy kept at the start, batch label shares counted as they are yielded, ...).
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Dict, Iterator, List

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from telemetry import TelemetryConfig, TrainingTelemetry  # noqa: E402

TARGET_COLLECTIONS = 50  # collect_every_n is chosen so that each run has about this many records


@dataclass
class Verdict:
    """Is the run's label true? `value` is the number shown in the table, `detail` says what it means."""
    ok: bool
    value: str
    detail: str
    numbers: Dict[str, Any] = field(default_factory=dict)


# ---- Data ---------------------------------------------------------------------------------------------

@lru_cache(maxsize=None)
def _sklearn(name: str):
    from sklearn import datasets

    loaded = {"digits": datasets.load_digits, "breast_cancer": datasets.load_breast_cancer,
              "diabetes": datasets.load_diabetes, "wine": datasets.load_wine}[name]()
    return loaded.data.astype(np.float32), loaded.target


SPLITS = {  # (train, holdout given to telemetry); the test set is everything else
    "digits": (1000, 100),        # 1797 examples: test 697
    "breast_cancer": (300, 60),   # 569: test 209
    "diabetes": (250, 50),        # 442: test 142
    "wine": (100, 30),            # 178 (3 classes): test 48
}


@dataclass
class Split:
    x: Dict[str, torch.Tensor]
    y: Dict[str, torch.Tensor]
    num_classes: int  # 0 for regression


def load_split(name: str, seed: int, raw: bool = False, raw_target: bool = False, thin_class0: int = 0) -> Split:
    """Train / holdout / test, shuffled by the run's random seed; features (and a regression's target)
    standardised with train statistics unless `raw` (`raw_target`): the unscaled-inputs (-targets) plants.
    `thin_class0` = n keeps one class-0 example in n in every part alike: a rare class, not a shifted one."""
    data, target = _sklearn(name)
    n_train, n_hold = SPLITS[name]
    order = np.random.RandomState(1000 + seed).permutation(len(data))
    parts = {"train": order[:n_train], "holdout": order[n_train:n_train + n_hold], "test": order[n_train + n_hold:]}
    if thin_class0:  # the 1st, (n+1)th, ... class-0 example of each part, in the shuffled order
        rare = {k: (np.cumsum(target[v] == 0) - 1) % thin_class0 == 0 for k, v in parts.items()}
        parts = {k: v[(target[v] != 0) | rare[k]] for k, v in parts.items()}
    if name == "digits":
        data = data / 16.0  # pixel intensities 0..16; kept non-negative (the dead-ReLU plant relies on it)
    elif not raw:
        mean, std = data[parts["train"]].mean(0), data[parts["train"]].std(0) + 1e-6
        data = (data - mean) / std
    regression = name == "diabetes"
    if regression and not raw_target:  # target standardised with train statistics too
        tm, ts = target[parts["train"]].mean(), target[parts["train"]].std()
        target = ((target - tm) / ts).astype(np.float32)
    x = {k: torch.tensor(data[v], dtype=torch.float32) for k, v in parts.items()}
    y = {k: torch.tensor(target[v], dtype=torch.float32 if regression else torch.long) for k, v in parts.items()}
    return Split(x, y, 0 if regression else int(target.max()) + 1)


# ---- Models -------------------------------------------------------------------------------------------
# Every classifier has a `backbone` and a `head`, so runs can put them in two named optimizer groups.
# forward(pixels) serves tuple batches (model(x)) and dict batches (model(pixels=x)) alike.

def _act(name: str) -> nn.Module:
    return {"relu": nn.ReLU(), "tanh": nn.Tanh(), "sigmoid": nn.Sigmoid()}[name]


class MLP(nn.Module):
    def __init__(self, n_in: int, hidden: List[int], n_out: int, act: str = "relu", neck: int = 0,
                 input_norm: bool = False):
        super().__init__()
        # `input_norm`: a BatchNorm1d on the inputs first, which makes raw features of any scale trainable
        layers, width = [nn.BatchNorm1d(n_in)] if input_norm else [], n_in
        for h in hidden:
            layers += [nn.Linear(width, h), _act(act)]
            width = h
        self.backbone = nn.Sequential(*layers)
        # `neck`: an extra layer between backbone and head (the not-in-optimizer plant leaves it out).
        self.neck = nn.Sequential(nn.Linear(width, neck), nn.ReLU()) if neck else nn.Identity()
        self.head = nn.Linear(neck or width, n_out)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.head(self.neck(self.backbone(pixels)))


class DigitsCNN(nn.Module):
    """Two 3x3 convolutions and a max-pool on the 8x8 digits, then a linear head."""

    def __init__(self, n_out: int = 10, width: int = 8):
        super().__init__()
        self.backbone = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1), nn.ReLU(), nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2), nn.Flatten())
        self.head = nn.Linear(2 * width * 16, n_out)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(pixels.reshape(-1, 1, 8, 8)))


class LogReg(nn.Module):
    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.backbone = nn.Identity()
        self.head = nn.Linear(n_in, n_out)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.head(pixels)


def build_model(spec: Dict[str, Any], n_in: int, n_out: int) -> nn.Module:
    """`final`: "softmax" appends one to the head, "sigmoid" makes a binary head of one output with one (the
    probability_outputs plant: the loss applies its own on top)."""
    arch, final = spec["arch"], spec.get("final")
    n_out = 1 if final == "sigmoid" else n_out
    if arch == "cnn":
        model = DigitsCNN(n_out)
    elif arch == "logreg":
        model = LogReg(n_in, n_out)
    else:
        model = MLP(n_in, spec.get("hidden", [128, 128]), n_out, spec.get("act", "relu"), spec.get("neck", 0),
                    spec.get("input_norm", False))
    if final:
        model.head = nn.Sequential(model.head, nn.Softmax(-1) if final == "softmax" else nn.Sigmoid())
    return model


def _predicted(out: torch.Tensor) -> torch.Tensor:
    """The class of each row: argmax, or for one output (a sigmoid's probability) whether it is above 0.5."""
    return (out[:, 0] > 0.5).long() if out.shape[-1] == 1 else out.argmax(-1)


def _classification_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """What the runs train on: cross-entropy, or for one output BCEWithLogitsLoss (on a sigmoid's output, the
    plant)."""
    return F.binary_cross_entropy_with_logits(out[:, 0], y.float()) if out.shape[-1] == 1 else F.cross_entropy(out, y)


def make_optimizer(model: nn.Module, spec: Dict[str, Any]) -> torch.optim.Optimizer:
    """One group, or named backbone/head groups (head at head_mult x the lr; backbone_lr overrides);
    `weight_decay` for the optimizer (SGD and Adam add it to the gradient, AdamW applies it apart)."""
    lr = spec["lr"]
    if spec.get("groups") == "named":
        groups = [{"params": list(model.backbone.parameters()), "lr": spec.get("backbone_lr", lr), "name": "backbone"},
                  {"params": list(model.head.parameters()), "lr": lr * spec.get("head_mult", 10), "name": "head"}]
    elif spec.get("plant") == "not_in_optimizer":  # the neck is in no group: its gradient accumulates forever
        groups = [{"params": list(model.backbone.parameters()) + list(model.head.parameters())}]
    elif spec.get("plant") == "zero_frozen_head":  # the optimizer gets the trainable tensors, as usual when freezing
        groups = [{"params": [p for p in model.parameters() if p.requires_grad]}]
    else:
        groups = [{"params": list(model.parameters())}]
    kind, decay = spec["opt"], spec.get("weight_decay")  # decay: SGD's and Adam's 0, AdamW's 0.01 unless given
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=0.9, weight_decay=decay or 0)
    if kind == "adam":
        return torch.optim.Adam(groups, lr=lr, weight_decay=decay or 0)
    return torch.optim.AdamW(groups, lr=lr, weight_decay=0.01 if decay is None else decay)


def collect_every(total_steps: int) -> int:
    return max(1, round(total_steps / TARGET_COLLECTIONS))


def _snapshot(module: nn.Module) -> Dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _distance(module: nn.Module, start: Dict[str, torch.Tensor]) -> float:
    """||w - w_0|| over the module's parameters, in float64."""
    return math.sqrt(sum(float((p.detach().double() - start[k].double()).square().sum())
                         for k, p in module.named_parameters()))


def _identical(module: nn.Module, start: Dict[str, torch.Tensor]) -> bool:
    now = module.state_dict()
    return all(torch.equal(now[k], v) for k, v in start.items())


# ---- Batches ------------------------------------------------------------------------------------------

def _order(n: int, rng: np.random.RandomState, spec: Dict[str, Any], y: np.ndarray) -> Iterator[np.ndarray]:
    """Index arrays of one batch each, forever: shuffled epochs, or a planted order."""
    bs, plant = spec["batch"], spec.get("plant")
    if plant == "class_imbalance":  # a sampler that draws `major_share` of every batch from class 0
        major, rest = np.where(y == 0)[0], np.where(y != 0)[0]
        while True:
            from_major = rng.rand(bs) < spec.get("major_share", 0.88)
            yield np.where(from_major, rng.choice(major, bs), rng.choice(rest, bs))
    if spec.get("sampler") == "balanced":  # WeightedRandomSampler, weights 1/class count: balanced batches
        weights = torch.from_numpy(1.0 / np.bincount(y)[y])
        generator = torch.Generator().manual_seed(int(rng.randint(2 ** 31)))
        sampler = torch.utils.data.WeightedRandomSampler(weights, n - n % bs, generator=generator)  # an epoch each
        while True:
            drawn = np.array(list(sampler))
            for s in range(0, len(drawn), bs):
                yield drawn[s:s + bs]
    if plant == "unshuffled":  # sorted by class, never shuffled: each batch holds one or two classes
        order = np.argsort(y, kind="stable")
        while True:
            for s in range(0, n - bs + 1, bs):
                yield order[s:s + bs]
    first = None
    while True:
        order = rng.permutation(n)
        for s in range(0, n - bs + 1, bs):  # drop the last short batch, as DataLoader(drop_last=True)
            if plant == "repeated_batch":  # the loader bug: the same batch every step
                first = order[s:s + bs] if first is None else first
                yield first
            else:
                yield order[s:s + bs]


def _as_batch(x: torch.Tensor, y: torch.Tensor, fmt: str, label_key: str, idx: np.ndarray):
    """`fmt` "indexed": (x, y, index), what a loader yields over a Dataset that returns each example's index
    third (`idx`: the examples' positions in their split)."""
    if fmt == "indexed":
        return x, y, torch.from_numpy(idx)
    return {"pixels": x, label_key: y} if fmt == "dict" else (x, y)


def _inputs(batch) -> torch.Tensor:
    return batch["pixels"] if isinstance(batch, dict) else batch[0]


# ---- The classifier / regressor loop ------------------------------------------------------------------

@dataclass
class Trace:
    """What the loop measured while training, for the verification."""
    losses: List[float] = field(default_factory=list)
    test_steps: List[int] = field(default_factory=list)
    test_loss: List[float] = field(default_factory=list)
    test_metric: List[float] = field(default_factory=list)
    label_counts: Dict[int, int] = field(default_factory=dict)
    classes_per_batch: List[int] = field(default_factory=list)
    batch_keys: set = field(default_factory=set)
    grads_seen_at_hook: List[bool] = field(default_factory=list)
    neck_grad_norms: List[float] = field(default_factory=list)
    train_acc: List[float] = field(default_factory=list)
    grad_ids: set = field(default_factory=set)
    pre_clip_norms: List[float] = field(default_factory=list)
    lrs: List[float] = field(default_factory=list)
    swaps: List[tuple] = field(default_factory=list)  # (distance from the start before, after) of each EMA swap


def plant_labels(y: torch.Tensor, spec: Dict[str, Any], k: int, rng: np.random.RandomState) -> torch.Tensor:
    y = y.clone()
    plant = spec.get("plant")
    if spec.get("label_noise"):  # noisy but healthy: a share of labels replaced by uniform random classes
        flip = torch.from_numpy(rng.rand(len(y)) < spec["label_noise"])
        y[flip] = torch.from_numpy(rng.randint(0, k, int(flip.sum())))
    if plant == "misaligned" and spec.get("variant") == "shift":
        y = (y + 1) % k  # every class relabelled as the next one
    elif plant == "misaligned":
        y = y[torch.from_numpy(rng.permutation(len(y)))]  # the label vector shuffled against the inputs
    return y


def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, regression: bool):
    """(loss, metric) on a whole set: accuracy for classification, R^2 for regression."""
    was = model.training
    model.eval()
    with torch.no_grad():
        out = model(x)
        if regression:
            out, y = out.reshape(-1), y.float()
            loss = F.mse_loss(out, y).item()
            metric = 1.0 - loss / float(((y - y.mean()) ** 2).mean())
        else:
            loss = _classification_loss(out, y).item()
            metric = (_predicted(out) == y).float().mean().item()
    model.train(was)
    return loss, metric


def init_plants(model: nn.Module, spec: Dict[str, Any]) -> None:
    plant = spec.get("plant")
    if plant == "zero_frozen_head":  # the head's weight zeroed and frozen (its bias trains): the output ignores the inputs
        nn.init.zeros_(model.head.weight)
        model.head.weight.requires_grad_(False)
    with torch.no_grad():
        if plant == "dead_relu":  # first-layer biases far below zero: those ReLUs never fire
            model.backbone[0].bias.fill_(spec.get("dead_bias", -5.0))
        if plant == "saturated":  # weights x10: tanh/sigmoid pre-activations far out in the flat tails
            for m in model.backbone:
                if isinstance(m, nn.Linear):
                    m.weight.mul_(10.0)


def train_classifier(spec: Dict[str, Any], out_dir: str, seed: int) -> Dict[str, Any]:
    torch.manual_seed(seed)
    rng = np.random.RandomState(seed)
    data = load_split(spec["data"], seed, raw=spec.get("raw", False), raw_target=spec.get("raw_target", False),
                      thin_class0=spec.get("thin_class0", 0))
    if spec.get("plant") == "constant_inputs":  # the pipeline's bug: the digits' 0-16 pixels floor-divided by 255
        data.x = {k: torch.div(v * 16, 255, rounding_mode="floor") for k, v in data.x.items()}
    # `ordinal`: the class indices kept as integer labels, fitted by one output under MSE, as a regression
    regression = data.num_classes == 0 or spec.get("ordinal", False)
    k = data.num_classes
    x_train = data.x["train"]
    y_train = plant_labels(data.y["train"], spec, k, rng) if not regression else data.y["train"]
    if spec.get("train_size"):  # the overfitting plant: a tiny train set, the same number of each class
        per_class = spec["train_size"] // k
        keep = torch.cat([torch.where(y_train == c)[0][:per_class] for c in range(k)])
        x_train, y_train = x_train[keep], y_train[keep]
    model = build_model(spec, x_train.shape[1], 1 if regression else k)
    init_plants(model, spec)
    start = _snapshot(model)
    optimizer = make_optimizer(model, spec)
    plant = spec.get("plant")
    if plant == "stale_optimizer":  # the bug: the model created again after the optimizer; this one is trained
        model = build_model(spec, x_train.shape[1], 1 if regression else k)
        start = _snapshot(model)
    scheduler = None
    if spec.get("schedule") == "cosine":  # cosine decay to 10% of each group's lr over the run
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda i: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(i, spec["steps"]) / spec["steps"])))
    if spec.get("schedule") == "warmup":  # linear warmup over `warmup` optimizer steps, then the base lr
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / spec["warmup"]))
    ema = torch.optim.swa_utils.AveragedModel(model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.99)) \
        if plant == "ema_swap_kept" else None
    if plant == "frozen":  # frozen after the optimizer was built: its group keeps lr > 0
        model.backbone.requires_grad_(False)

    steps, fmt = spec["steps"], spec.get("format", "tuple")
    every = spec.get("collect_every_n") or collect_every(steps)
    label_key = "target" if regression else "label"
    telemetry = TrainingTelemetry(TelemetryConfig(output_dir=out_dir, collect_every_n=every,
                                                  holdout_size=len(data.y["holdout"]), batch_label_key=label_key
                                                  if fmt == "dict" else None))
    held, held_y = data.x["holdout"], data.y["holdout"]
    if plant == "holdout_off_scale":  # the pipeline's bug: the holdout skips the standardisation (raw features)
        held = load_split(spec["data"], seed, raw=True).x["holdout"]
    if plant == "holdout_leak":  # the bug: the holdout taken from the training examples, the split forgotten
        held, held_y = x_train[:len(held_y)], y_train[:len(held_y)]
    holdout = _as_batch(held, held_y, fmt, label_key, np.arange(len(held_y)))
    if fmt == "indexed":  # told how: by default an (inputs..., labels) batch would run model(x, y) against the index
        telemetry.set_holdout_data(holdout, forward=lambda m, b: m(b[0]), labels=lambda b: b[1])
    else:
        telemetry.set_holdout_data(holdout)

    loss_fn = (lambda out, y: F.mse_loss(out.squeeze(-1), y.float())) if regression else _classification_loss
    if plant == "negative_loss":  # the bug: NLLLoss on raw outputs, which expects log-probabilities
        loss_fn = F.nll_loss
    batches = _order(len(y_train), rng, spec, y_train.numpy())
    per_epoch = max(1, len(y_train) // spec["batch"])
    trace = Trace()
    # The bad batch lands on a collected step (telemetry sees nothing of the steps in between); the NaN one
    # step after a collection, since a NaN stays in the weights.
    bad_step = spec.get("bad_step_frac") and (every * max(1, round(spec["bad_step_frac"] * steps / every))
                                              + (plant == "nan_input"))
    model.train()
    for step in range(1, steps + 1):
        idx = next(batches)
        xb, yb = x_train[idx], y_train[idx]
        if plant == "nan_input" and step == bad_step:
            xb = xb.clone()
            xb[0, 0] = float("nan")  # one NaN feature in one batch
        if plant == "bad_batch" and step == bad_step:
            xb = xb * 1000.0  # one batch with inputs scaled x1000 (a unit mix-up), then back to normal
        batch = _as_batch(xb, yb, fmt, label_key, idx)
        _count_batch(trace, idx, yb, regression)
        out = model(_inputs(batch))
        loss = loss_fn(out, yb)
        loss.backward()
        if spec.get("clip"):  # clip_grad_norm_ at max_norm `clip`; it returns the norm before clipping
            trace.pre_clip_norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), spec["clip"])))
        optimizer.step()
        if ema is not None:
            ema.update_parameters(model)
        trace.lrs.append(optimizer.param_groups[0]["lr"])
        # the warmup_per_epoch plant: the warmup counts optimizer steps, but the loop steps it once per epoch
        if scheduler is not None and (plant != "warmup_per_epoch" or step % per_epoch == 0):
            scheduler.step()
        if plant == "zero_grad_before_hook":
            optimizer.zero_grad()  # the bug: gradients cleared between step() and the hook
            trace.grads_seen_at_hook.append(any(p.grad is not None and bool(p.grad.any())
                                                for p in model.parameters()))
        if plant == "not_in_optimizer":
            trace.neck_grad_norms.append(float(torch.cat([p.grad.reshape(-1) for p in model.neck.parameters()])
                                               .norm()))
        acc = None if regression else (_predicted(out) == yb).float().mean()
        trace.losses.append(float(loss))
        if acc is not None:
            trace.train_acc.append(float(acc))
        scalars = {} if acc is None else {"train_acc": acc}
        telemetry.on_batch_end(model, optimizer, step, (step - 1) // per_epoch, batch=batch, loss=loss, **scalars)
        if plant == "eval_mode" and step == per_epoch:  # the bug: model.eval() for a pass, never train() again
            model.eval()
        if ema is not None and step % per_epoch == 0:  # the EMA's weights evaluated at each epoch's end
            before = _distance(model, start)
            backup = model.state_dict()  # the bug: the model's own tensors, not a copy of them
            model.load_state_dict(ema.module.state_dict())
            model.load_state_dict(backup)  # "restores" the EMA's weights, which load_state_dict copied into them
            trace.swaps.append((step, before, _distance(model, start)))
        if plant == "grads_never_zeroed":  # the bug: no zero_grad, so backward() adds into the same gradients
            trace.grad_ids.add(id(next(model.parameters()).grad))
        else:
            optimizer.zero_grad()
        if step % every == 0 or step == steps:  # the test-loss curve, at every collection
            test_loss, test_metric = evaluate(model, data.x["test"], data.y["test"], regression)
            trace.test_steps.append(step)
            trace.test_loss.append(test_loss)
            trace.test_metric.append(test_metric)
    telemetry.close()
    context = dict(spec=spec, model=model, start=start, data=data, trace=trace, y_train=y_train, seed=seed,
                   regression=regression, bad_step=bad_step, x_train=x_train, held=held)
    return {"collect_every_n": every, "steps": steps, "verdict": verify_classifier(context)}


def _count_batch(trace: Trace, idx: np.ndarray, yb: torch.Tensor, regression: bool) -> None:
    trace.batch_keys.add(hash(idx.tobytes()))
    if not regression:
        values = yb.tolist()
        for v in values:
            trace.label_counts[v] = trace.label_counts.get(v, 0) + 1
        trace.classes_per_batch.append(len(set(values)))


# ---- Verification of the classifier runs --------------------------------------------------------------

def reference_score(data: Split, y_train: torch.Tensor, x_train: torch.Tensor) -> float:
    """The dataset's achievable level on this split: a scikit-learn linear model fitted on the same train
    examples and labels (logistic regression: test accuracy; ridge: test R^2)."""
    from sklearn.linear_model import LogisticRegression, Ridge
    from threadpoolctl import threadpool_limits

    with threadpool_limits(1):  # a multi-threaded BLAS on a busy 2-core machine is 10x slower here
        if data.num_classes == 0:
            model = Ridge(alpha=1.0).fit(x_train.numpy(), y_train.numpy())
        else:
            model = LogisticRegression(max_iter=2000).fit(x_train.numpy(), y_train.numpy())
        return float(model.score(data.x["test"].numpy(), data.y["test"].numpy()))


def test_loss_rise(test_loss: List[float]) -> tuple:
    """(end, best) of the test-loss curve, each a 3-point moving median: one noisy evaluation (small
    batches, SGD) neither makes nor hides a rise."""
    x = np.array(test_loss)
    m = np.array([np.median(x[max(0, i - 2):i + 1]) for i in range(len(x))])
    return float(m[-1]), float(np.min(m))


def _healthy(ctx) -> Verdict:
    """Healthy: the test metric at the end (median of the last 3 evaluations, one per collection) within
    `margin` of the reference, and no overfitting: the smoothed test loss at the end within 20% of its best."""
    t, spec = ctx["trace"], ctx["spec"]
    ref = reference_score(ctx["data"], ctx["y_train"], ctx["x_train"])
    end, best = test_loss_rise(t.test_loss)
    metric = float(np.median(t.test_metric[-3:]))
    margin = spec.get("margin", 0.05)
    name = "R2" if ctx["regression"] else "acc"
    ok = metric >= ref - margin and end <= 1.2 * best and math.isfinite(end)
    return Verdict(ok, f"test {name} {metric:.3f}",
                   f"test {name} {metric:.3f} vs linear reference {ref:.3f} (needs >= {ref - margin:.3f}); "
                   f"test loss at the end {end:.3f} vs best {best:.3f} (needs <= 1.2x)",
                   {"test_metric": metric, "reference": ref, "test_loss_end": end, "test_loss_best": best,
                    "test_loss_curve": [round(v, 4) for v in t.test_loss]})


def _healthy_balanced(ctx) -> Verdict:
    """Healthy with a rare class: balanced accuracy (the mean of the classes' recalls) on the test set, which
    keeps the rare class as rare, above 0.9, and the test loss at the end within 20% of its best."""
    x, y = ctx["data"].x["test"], ctx["data"].y["test"]
    with torch.no_grad():
        pred = _predicted(ctx["model"].eval()(x))
    recalls = [float((pred[y == c] == c).float().mean()) for c in range(ctx["data"].num_classes)]
    balanced = float(np.mean(recalls))
    end, best = test_loss_rise(ctx["trace"].test_loss)
    ok = balanced > 0.9 and end <= 1.2 * best
    return Verdict(ok, f"test balanced acc {balanced:.3f}",
                   f"test balanced accuracy {balanced:.3f} (needs > 0.9; recall per class "
                   f"{', '.join(f'{r:.3f}' for r in recalls)}, class counts {np.bincount(y.numpy()).tolist()}); test "
                   f"loss at the end {end:.3f} vs best {best:.3f} (needs <= 1.2x)",
                   {"test_metric": balanced, "test_loss_end": end, "test_loss_best": best,
                    "test_loss_curve": [round(v, 4) for v in ctx["trace"].test_loss]})


def _healthy_ordinal(ctx) -> Verdict:
    """Healthy for class indices fitted by MSE: the test MSE at the end (median of the last 3 evaluations)
    under a quarter of the test labels' variance (what predicting their mean scores), and not rising."""
    t = ctx["trace"]
    var = float(ctx["data"].y["test"].float().var(unbiased=False))
    end, best = test_loss_rise(t.test_loss)
    mse = float(np.median(t.test_loss[-3:]))
    ok = mse < 0.25 * var and end <= 1.2 * best
    return Verdict(ok, f"test MSE {mse:.3f} vs var {var:.3f}",
                   f"test MSE {mse:.3f} against the test labels' variance {var:.3f} (needs < a quarter); test loss "
                   f"at the end {end:.3f} vs best {best:.3f} (needs <= 1.2x)",
                   {"test_metric": mse, "test_loss_end": end, "test_loss_best": best,
                    "test_loss_curve": [round(v, 4) for v in t.test_loss]})


def _chance_band(k: int, n: int) -> float:
    return 1.0 / k + 3 * math.sqrt((1.0 / k) * (1 - 1.0 / k) / n)


def verify_classifier(ctx) -> Verdict:
    spec, t, model, start = ctx["spec"], ctx["trace"], ctx["model"], ctx["start"]
    plant = spec.get("plant")
    if plant is None:
        if spec.get("thin_class0"):
            return _healthy_balanced(ctx)
        return _healthy_ordinal(ctx) if spec.get("ordinal") else _healthy(ctx)
    acc = t.test_metric[-1]
    if plant in ("frozen", "lr_zero"):
        frozen = _identical(model.backbone, {k[len("backbone."):]: v for k, v in start.items()
                                             if k.startswith("backbone.")})
        head_moved = not _identical(model.head, {k[len("head."):]: v for k, v in start.items()
                                                 if k.startswith("head.")})
        return Verdict(frozen and head_moved, f"backbone bit-identical={frozen}",
                       f"backbone weights bit-identical to the start copy: {frozen}; head moved: {head_moved}")
    if plant == "misaligned":
        # The labels carry no information: they agree with the true classes no more often than chance. What
        # the model then reaches is not a tight binomial: with a shuffled label vector each true class ends
        # up mapped to its most frequent random label, so the test accuracy moves in steps of ~1/K.
        k, y_true = ctx["data"].num_classes, ctx["data"].y["train"]
        agree = float((ctx["y_train"] == y_true).float().mean())
        ref = reference_score(ctx["data"], y_true, ctx["x_train"])
        ok = agree <= _chance_band(k, len(y_true)) and acc <= 0.5 * ref
        return Verdict(ok, f"labels agree {agree:.1%}, test acc {acc:.3f}",
                       f"{agree:.1%} of the training labels are the true class (needs <= "
                       f"{_chance_band(k, len(y_true)):.1%}: 1/{k} + 3 binomial sigmas); test accuracy on the true "
                       f"labels {acc:.3f} (needs <= half the {ref:.3f} a linear model reaches with the true labels)")
    if plant == "overfitting":
        end, best = test_loss_rise(t.test_loss)
        train_acc = float(np.mean(t.train_acc[-10:]))
        ok = end >= 1.3 * best and train_acc >= 0.99
        return Verdict(ok, f"test loss x{end / best:.2f}",
                       f"test loss (3-point moving median) rose from its best {best:.3f} to {end:.3f} (needs >= "
                       f"1.3x) while train accuracy is {train_acc:.3f} (needs >= 0.99); test acc {acc:.3f}",
                       {"test_loss_curve": [round(v, 4) for v in t.test_loss]})
    if plant == "lr_too_high":  # diverged: NaN/inf, or no better than at the start / than chance
        losses = np.array(t.losses)
        nonfinite = not np.isfinite(losses).all()
        first = float(np.median(losses[:10]))
        late = losses[-len(losses) // 5:]
        late_med = float(np.median(late)) if np.isfinite(late).all() else math.inf
        if ctx["regression"]:
            useless, what = not (acc > 0), f"test R2 {acc:.3g} (useless <= 0)"
        else:
            band = _chance_band(ctx["data"].num_classes, len(ctx["data"].y["test"]))
            useless, what = acc <= band, f"test acc {acc:.3f} (chance band <= {band:.3f})"
        ok = nonfinite or late_med >= first or useless
        return Verdict(ok, "loss NaN/inf" if nonfinite else f"loss {first:.3g}->{late_med:.3g}",
                       f"non-finite loss: {nonfinite}"
                       + (f" (first at step {int(np.argmin(np.isfinite(losses))) + 1})" if nonfinite else "")
                       + f"; median train loss over the first 10 steps {first:.3g}, over the last fifth "
                       f"{late_med:.3g}; {what}")
    if plant == "nan_input":
        bad = [n for n, p in model.named_parameters() if not torch.isfinite(p).all()]
        step = ctx["bad_step"]
        ok = bool(bad) and not math.isfinite(t.losses[step - 1])
        return Verdict(ok, f"{len(bad)} NaN tensors",
                       f"loss at the injected step {step}: {t.losses[step - 1]}; {len(bad)} parameter tensors "
                       f"non-finite at the end")
    if plant == "bad_batch":
        step = ctx["bad_step"]
        before = float(np.median(t.losses[max(0, step - 21):step - 1]))
        jump = t.losses[step - 1] / before
        healthy = _healthy(ctx)
        ok = jump >= 10 and healthy.ok
        return Verdict(ok, f"loss x{jump:.0f}, then {healthy.value}",
                       f"loss at step {step} {t.losses[step - 1]:.3g} = {jump:.0f}x the median of the 20 steps "
                       f"before (needs >= 10x); recovered: {healthy.detail}")
    if plant == "lr_too_low":
        losses = np.array(t.losses)
        first, last = float(np.median(losses[:20])), float(np.median(losses[-20:]))
        change = (first - last) / first
        ok = abs(change) < 0.01
        return Verdict(ok, f"loss {change:+.2%}",
                       f"train loss median {first:.4f} over the first 20 steps, {last:.4f} over the last 20 "
                       f"({change:+.2%}; needs |change| < 1%); test acc {acc:.3f}")
    if plant == "warmup_per_epoch":  # the lr never left the warmup's start, and the model at chance
        band = _chance_band(ctx["data"].num_classes, len(ctx["data"].y["test"]))
        peak = max(t.lrs)
        return Verdict(acc <= band, f"lr peak {peak:.1e}, test acc {acc:.3f}",
                       f"test acc {acc:.3f} (needs <= {band:.3f}: chance + 3 binomial sigmas); the lr peaked at "
                       f"{peak:.2e}, {peak / spec['lr']:.2%} of the optimizer's {spec['lr']:g}")
    if plant == "ema_swap_kept":  # each epoch starts again from the lagging EMA's weights, and its loss climbs back
        back = [(step, a, b) for step, a, b in t.swaps if b < 0.7 * a]
        rises = [float(np.median(t.losses[step:step + 5])) / float(np.median(t.losses[step - 5:step]))
                 for step, _, _ in back if step + 5 <= len(t.losses)]
        ok = len(back) >= 3 and len(rises) >= 3 and float(np.median(rises)) >= 1.2
        return Verdict(ok, f"{len(back)} rollbacks, loss x{np.median(rises) if rises else math.nan:.2f}",
                       f"{len(back)} of {len(t.swaps)} swaps put the weights back (their distance from the start "
                       f"fell by 30% or more; needs 3); the median train loss of the 5 steps after them is "
                       f"{np.median(rises) if rises else math.nan:.2f}x that of the 5 before (needs >= 1.2)")
    if plant == "zero_frozen_head":  # no gradient reaches the backbone, and the model predicts one class
        x, y = ctx["data"].x["test"], ctx["data"].y["test"]
        model.zero_grad()
        _classification_loss(model.train()(x), y).backward()
        cut = all(p.grad is not None and not p.grad.any() for p in model.backbone.parameters())
        # a model that predicts one class scores that class's share: the majority's at most
        band = max(_chance_band(ctx["data"].num_classes, len(y)), float(np.bincount(y.numpy()).max()) / len(y))
        return Verdict(cut and acc <= band + 1e-6, f"backbone grads all 0={cut}, test acc {acc:.3f}",
                       f"a backward on the test set leaves every backbone gradient exactly 0: {cut} (needs True); "
                       f"test acc {acc:.3f} (needs <= {band:.3f}: chance + 3 binomial sigmas, or the majority class's "
                       "share)")
    if plant == "stale_optimizer":  # the optimizer steps the first instance: the trained one never changes
        same = _identical(model, start)
        return Verdict(same, f"weights bit-identical={same}, test acc {acc:.3f}",
                       f"the trained model's weights bit-identical to the copy taken when it was created: {same} "
                       f"(needs True); test acc {acc:.3f}")
    if plant == "class_imbalance":
        total = sum(t.label_counts.values())
        share = t.label_counts.get(0, 0) / total
        return Verdict(share >= 0.8, f"class 0 {share:.1%}",
                       f"class 0 is {share:.1%} of the {total} training examples drawn (needs >= 80%)")
    if plant == "unshuffled":
        mean = float(np.mean(t.classes_per_batch))
        return Verdict(mean <= 2.0, f"{mean:.2f} classes/batch",
                       f"batches hold {mean:.2f} distinct classes on average (needs <= 2; a shuffled batch of "
                       f"{spec['batch']} holds ~{_expected_classes(ctx):.1f})")
    if plant == "repeated_batch":
        n = len(t.batch_keys)
        return Verdict(n == 1, f"{n} distinct batch",
                       f"{n} distinct batch(es) over {len(t.losses)} steps (needs 1)")
    if plant == "grads_never_zeroed":  # one gradient tensor for the whole run, added into at every step
        return Verdict(len(t.grad_ids) == 1, f"{len(t.grad_ids)} grad tensor, test acc {acc:.3f}",
                       f"the first weight's gradient was {len(t.grad_ids)} tensor(s) over the run (needs 1); test acc "
                       f"{acc:.3f}")
    if plant == "zero_grad_before_hook":
        seen = sum(t.grads_seen_at_hook)
        return Verdict(seen == 0, f"grads at hook {seen}/{len(t.grads_seen_at_hook)}",
                       f"the hook found non-zero gradients in {seen} of {len(t.grads_seen_at_hook)} calls (needs 0)")
    if plant == "not_in_optimizer":
        neck_start = {k[len("neck."):]: v for k, v in start.items() if k.startswith("neck.")}
        same = _identical(model.neck, neck_start)
        growth = t.neck_grad_norms[-1] / t.neck_grad_norms[0]
        ok = same and growth >= 10
        return Verdict(ok, f"neck grad x{growth:.0f}",
                       f"neck weights bit-identical to the start: {same}; its accumulated gradient norm grew "
                       f"{growth:.0f}x from the first step (needs >= 10x)")
    if plant == "probability_outputs":  # the loss capped at its floor on probabilities; the outputs themselves good
        x, y = ctx["data"].x["test"], ctx["data"].y["test"]
        with torch.no_grad():
            p = model.eval()(x)
        if p.shape[-1] == 1:
            share = float(ctx["y_train"].float().mean())
            floor = share * math.log1p(1 / math.e) + (1 - share) * math.log(2)
            own = F.binary_cross_entropy(p[:, 0].clamp(1e-7, 1 - 1e-7), y.float()).item()
        else:
            floor = math.log1p((p.shape[-1] - 1) / math.e)
            own = F.nll_loss(p.clamp_min(1e-7).log(), y).item()
        capped = t.test_loss[-1]
        ok = floor * 0.95 <= capped <= 1.2 * floor and own < 0.5 * floor
        return Verdict(ok, f"loss {capped:.3f} at floor {floor:.3f}",
                       f"the loss trained on, on the test set: {capped:.3f} against its floor on probabilities "
                       f"{floor:.3f} (needs 0.95-1.2x); the outputs' own log-loss {own:.3f} (needs < half the "
                       f"floor); test acc {acc:.3f}")
    if plant == "unscaled_inputs":  # far off scale, and far below what the same data standardised allows
        x_train = ctx["x_train"]
        rms = float(x_train.double().square().mean().sqrt())
        mean, std = x_train.mean(0), x_train.std(0) + 1e-6
        scaled = Split({k: (v - mean) / std for k, v in ctx["data"].x.items()}, ctx["data"].y, ctx["data"].num_classes)
        ref = reference_score(scaled, ctx["y_train"], (x_train - mean) / std)
        ok = rms >= 10 and acc <= ref - 0.03
        return Verdict(ok, f"rms {rms:.0f}, test acc {acc:.3f}",
                       f"train inputs' root mean square {rms:.1f} (needs >= 10); test acc {acc:.3f} vs {ref:.3f} for "
                       f"a linear model on the same features standardised (needs <= {ref - 0.03:.3f})")
    if plant == "unscaled_targets":  # far off scale, and far below what a linear model reaches (R^2 ignores scale)
        rms = float(ctx["y_train"].double().square().mean().sqrt())
        ref = reference_score(ctx["data"], ctx["y_train"], ctx["x_train"])
        ok = rms >= 10 and not acc > ref - 0.1
        return Verdict(ok, f"rms {rms:.0f}, test R2 {acc:.3f}",
                       f"train targets' root mean square {rms:.1f} (needs >= 10); test R^2 {acc:.3f} vs {ref:.3f} for "
                       f"ridge regression (needs <= {ref - 0.1:.3f}, or not a number)")
    if plant == "eval_mode":  # in eval mode from the end of the first epoch on, with layers the mode changes
        layers = sum(isinstance(m, (nn.BatchNorm1d, nn.Dropout)) for m in model.modules())
        ok = not model.training and layers > 0
        return Verdict(ok, f"eval mode {not model.training}, {layers} layer(s)",
                       f"model.training at the end {model.training} (needs False); BatchNorm or dropout layers: "
                       f"{layers} (needs > 0); test acc {acc:.3f}")
    if plant == "negative_loss":  # the loss ran far below 0, and the model at chance on the test set
        finite = [v for v in t.losses if math.isfinite(v)]
        lowest = min(finite) if finite else math.nan
        band = _chance_band(ctx["data"].num_classes, len(ctx["data"].y["test"]))
        ok = lowest < -10 and acc <= band
        return Verdict(ok, f"train loss down to {lowest:.3g}, test acc {acc:.3f}",
                       f"lowest finite train loss {lowest:.3g} (needs < -10: a cross-entropy is never negative); "
                       f"test acc {acc:.3f} (needs <= {band:.3f}: chance + 3 binomial sigmas)")
    if plant == "holdout_off_scale":  # the holdout on another scale, the model itself healthy on the test set
        held = ctx["held"].double()   # the holdout telemetry was given
        ratio = float(held.square().mean().sqrt() / ctx["x_train"].double().square().mean().sqrt())
        healthy = _healthy(ctx)
        ok = (ratio >= 4 or ratio <= 0.25) and healthy.ok
        return Verdict(ok, f"holdout x{ratio:.3g}, {healthy.value}",
                       f"the holdout's inputs' root mean square {ratio:.3g}x the train inputs' (needs >= 4x or <= "
                       f"0.25x); on the standardised test set: {healthy.detail}")
    if plant == "holdout_leak":  # every holdout example is a training example, input for input
        inside = sum(bool((ctx["x_train"] == row).all(1).any()) for row in ctx["held"])
        return Verdict(inside == len(ctx["held"]), f"{inside}/{len(ctx['held'])} in train",
                       f"{inside} of the {len(ctx['held'])} holdout examples equal a training example "
                       "(needs all)")
    if plant == "constant_inputs":  # every train input one value, and the model at chance on the test set
        x = ctx["x_train"].double()
        spread = float(x.max() - x.min())
        band = _chance_band(ctx["data"].num_classes, len(ctx["data"].y["test"]))
        return Verdict(spread == 0 and acc <= band, f"input spread {spread:g}, test acc {acc:.3f}",
                       f"max - min over every train input {spread:g} (needs 0); test acc {acc:.3f} (needs <= "
                       f"{band:.3f}: chance + 3 binomial sigmas)")
    if plant == "over_clipped":  # clipped at every step, the weights barely moved, the model at chance
        clipped = all(n > spec["clip"] for n in t.pre_clip_norms)
        before = torch.cat([v.reshape(-1) for v in start.values()])
        moved = float((torch.cat([p.detach().reshape(-1) for p in model.parameters()]) - before).norm() / before.norm())
        band = _chance_band(ctx["data"].num_classes, len(ctx["data"].y["test"]))
        ok = clipped and moved < 0.01 and acc <= band
        return Verdict(ok, f"moved {moved:.1e}, test acc {acc:.3f}",
                       f"the norm before clipping above max_norm {spec['clip']} at every step: {clipped}; the weights "
                       f"moved {moved:.2e} of their norm over the run (needs < 0.01); test acc {acc:.3f} (needs <= "
                       f"{band:.3f}: chance + 3 binomial sigmas)")
    if plant == "weight_decay":  # the weights pulled to 0, and the model at chance on the test set
        before = torch.cat([v.reshape(-1) for v in start.values()]).norm().item()
        after = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).norm().item()
        band = _chance_band(ctx["data"].num_classes, len(ctx["data"].y["test"]))
        ok = after * 5 <= before and acc <= band
        return Verdict(ok, f"weights /{before / max(after, 1e-12):.0f}, test acc {acc:.3f}",
                       f"weight norm {before:.3g} at the start and {after:.3g} at the end (needs a fall of 5x or "
                       "more); "
                       f"test acc {acc:.3f} (needs <= {band:.3f}: chance + 3 binomial sigmas)")
    if plant == "dead_relu":
        share = dead_share(model, ctx["data"].x["test"])
        return Verdict(share >= 0.8, f"dead {share:.0%}",
                       f"{share:.1%} of first-layer ReLUs never fire on any of the {len(ctx['data'].y['test'])} "
                       f"test examples (needs >= 80%); test acc {acc:.3f}")
    if plant == "saturated":
        act, x_test = spec.get("act", "tanh"), ctx["data"].x["test"]
        share = saturated_share(model, x_test, act)
        torch.manual_seed(ctx["seed"])
        plain = saturated_share(build_model(spec, x_test.shape[1], ctx["data"].num_classes), x_test, act)
        ok = share >= 0.3 and share >= 10 * plain
        return Verdict(ok, f"saturated {share:.0%}",
                       f"{share:.1%} of hidden activations on the test set are saturated (|tanh| > 0.99 or sigmoid "
                       f"outside 0.01-0.99) vs {plain:.1%} in the same net at its default init (needs >= 30% and "
                       f">= 10x); test acc {acc:.3f}")
    if plant == "vanishing":
        ratio = first_last_grad_ratio(model, ctx["data"].x["test"], ctx["data"].y["test"])
        return Verdict(ratio <= 1e-3, f"grad ratio {ratio:.1e}",
                       f"first-layer / last-hidden-layer gradient norm on the test set {ratio:.2e} at the end "
                       f"(needs <= 1e-3); test acc {acc:.3f}")
    raise ValueError(f"no verification for plant {plant!r}")


def _expected_classes(ctx) -> float:
    y = ctx["y_train"].numpy()
    p = np.bincount(y) / len(y)
    return float(np.sum(1 - (1 - p) ** ctx["spec"]["batch"]))


def _hidden_activations(model: nn.Module, x: torch.Tensor) -> List[torch.Tensor]:
    acts = []
    with torch.no_grad():
        h = x
        for m in model.backbone:
            h = m(h)
            if isinstance(m, (nn.ReLU, nn.Tanh, nn.Sigmoid)):
                acts.append(h)
    return acts


def dead_share(model: nn.Module, x: torch.Tensor) -> float:
    """Share of first-layer units whose ReLU output is 0 on every example: a manual eval pass."""
    first = _hidden_activations(model.eval(), x)[0]
    return float((first.amax(0) <= 0).float().mean())


def saturated_share(model: nn.Module, x: torch.Tensor, act: str) -> float:
    acts = torch.cat([a.reshape(-1) for a in _hidden_activations(model.eval(), x)])
    sat = acts.abs() > 0.99 if act == "tanh" else (acts < 0.01) | (acts > 0.99)
    return float(sat.float().mean())


def first_last_grad_ratio(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    linears = [m for m in model.backbone if isinstance(m, nn.Linear)]
    ratio = float(linears[0].weight.grad.norm() / linears[-1].weight.grad.norm())
    model.zero_grad()
    return ratio
