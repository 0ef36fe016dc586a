"""The diagnosis corpus: small real training runs, each healthy or with one planted problem, run through
analyze_telemetry.py; prints how well the findings match the labels.

    python bench/diagnosis/corpus.py --out /tmp/corpus                       # every run, seeds 0 1 2
    python bench/diagnosis/corpus.py --out /tmp/corpus --only misaligned --seeds 0
    python bench/diagnosis/corpus.py --out /tmp/corpus --analyzer ../other/analyze_telemetry.py --json r.json
    python bench/diagnosis/corpus.py --rescore r.json --json r2.json   # the same runs, analyzed again

Every label is checked on the run itself (see README.md): a run whose check fails is shown as not verified
and left out of the totals.
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import io
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
import warnings
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from multiprocessing import get_context
from typing import Any, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
ALARM = ("warning", "critical")

# ---- What each planted problem should be called ---------------------------------------------------------
# problem: (named if any of these codes appears at warning/critical, the codes that count as its cause)
PROBLEMS: Dict[str, tuple] = {
    # requires_grad_(False) in a group with lr > 0: the records say exactly that (run.json's frozen tensors)
    "frozen": ({"frozen_parameters", "frozen_group"}, {"frozen_parameters"}),
    "lr_zero": ({"lr_zero", "frozen_group"}, {"lr_zero"}),
    "misaligned": ({"holdout_at_chance", "holdout_below_chance"}, {"holdout_at_chance", "holdout_below_chance"}),
    "grads_never_zeroed": ({"gradients_never_zeroed"}, {"gradients_never_zeroed"}),
    "unscaled_inputs": ({"unscaled_inputs"}, {"unscaled_inputs"}),
    "unscaled_targets": ({"unscaled_targets"}, {"unscaled_targets"}),
    "probability_outputs": ({"probability_outputs"}, {"probability_outputs"}),
    "overfitting": ({"overfitting"}, {"overfitting"}),
    "lr_too_high": ({"exploding_gradients", "loss_diverging", "nonfinite", "loss_oscillating"},
                    {"exploding_gradients", "loss_diverging", "nonfinite", "loss_oscillating"}),
    "nan_input": ({"nonfinite"}, {"nonfinite"}),
    # one bad batch: its loss spikes first, and the gradient jump at the same step follows from that loss
    "bad_batch": ({"loss_spike", "exploding_gradients", "grad_spike"}, {"loss_spike"}),
    "lr_too_low": ({"not_learning", "loss_stalled"}, {"not_learning", "loss_stalled"}),
    "class_imbalance": ({"class_imbalance"}, {"class_imbalance"}),
    "dead_relu": ({"dead_units"}, {"dead_units"}),
    "saturated": ({"saturated_units"}, {"saturated_units"}),
    "vanishing": ({"vanishing_gradients"}, {"vanishing_gradients"}),
    "repeated_batch": ({"repeated_batches"}, {"repeated_batches"}),
    "unshuffled": ({"unshuffled_batches"}, {"unshuffled_batches"}),
    "zero_grad_before_hook": ({"missing_gradients"}, {"missing_gradients"}),
    "lora_lr_zero": ({"lora_not_learning", "lr_zero"}, {"lr_zero", "lora_not_learning"}),
    "not_in_optimizer": ({"not_in_optimizer"}, {"not_in_optimizer"}),
    "labels_not_shifted": ({"labels_not_shifted"}, {"labels_not_shifted"}),
    # a forward that drops attention_mask on left-padded lines: each is read after its padding
    "padding_read": ({"padding_read"}, {"padding_read"}),
    # a text shuffled token by token: only the tokens' frequencies are left to learn
    "shuffled_tokens": ({"holdout_at_chance"}, {"holdout_at_chance"}),
    "eval_mode": ({"eval_mode"}, {"eval_mode"}),
    "negative_loss": ({"negative_loss"}, {"negative_loss"}),
    "holdout_off_scale": ({"holdout_off_scale"}, {"holdout_off_scale"}),
    "holdout_leak": ({"holdout_in_training"}, {"holdout_in_training"}),
    "constant_inputs": ({"constant_inputs"}, {"constant_inputs"}),
    "over_clipped": ({"gradients_clipped"}, {"gradients_clipped"}),
    # weight_decay added to every gradient, far above the usual: the weights collapse toward 0
    "weight_decay": ({"weights_collapsed"}, {"weights_collapsed"}),
    # a warmup counted in steps but stepped per epoch: the lr never leaves its first few thousandths
    "warmup_per_epoch": ({"lr_below_base"}, {"lr_below_base"}),
    # the optimizer holds the first instance of the model; the one trained is in no group
    "stale_optimizer": ({"not_in_optimizer"}, {"not_in_optimizer"}),
    # the head's weight zeroed and frozen: no gradient passes back to the layers before it
    "zero_frozen_head": ({"gradient_cut"}, {"gradient_cut"}),
    # an EMA's weights evaluated each epoch and "restored" from model.state_dict(): they stay in the model
    "ema_swap_kept": ({"weights_rolled_back"}, {"weights_rolled_back"}),
}


@dataclass(frozen=True)
class Spec:
    problem: str                 # "healthy" or a key of PROBLEMS
    arch: str                    # the run's name: architecture, data, what is special
    workload: str                # classifier | char_lm | padded_lm | lora
    knobs: Dict[str, Any] = field(default_factory=dict, hash=False)

    @property
    def name(self) -> str:
        return f"{self.problem}/{self.arch}"


def S(problem: str, arch: str, workload: str, /, **knobs) -> Spec:
    if problem != "healthy":
        knobs.setdefault("plant", problem)
    return Spec(problem, arch, workload, knobs)


def digits(**knobs) -> Dict[str, Any]:
    """The 8x8 digits: an MLP (128-128, ReLU) by default, batch 32, 400 steps."""
    return {"data": "digits", "arch": "mlp", "batch": 32, "steps": 400, **knobs}


def cancer(**knobs) -> Dict[str, Any]:
    """Breast cancer (binary, 30 features): an MLP with one hidden layer of 32, batch 16, dict batches."""
    return {"data": "breast_cancer", "arch": "mlp", "hidden": [32], "batch": 16, "steps": 400, "format": "dict",
            **knobs}


def diabetes(**knobs) -> Dict[str, Any]:
    """Diabetes regression (10 features, MSE): an MLP with one hidden layer of 32, batch 16."""
    return {"data": "diabetes", "arch": "mlp", "hidden": [32], "batch": 16, "steps": 400, **knobs}


# The corpus: one line per run, each trained once per seed. lr is the base lr; groups="named" puts the
# backbone at 1x and the head at 10x it, in optimizer groups named "backbone" and "head"; format is the
# batch type ("tuple" by default, "dict", or "indexed": (x, y, example index)); steps are optimizer steps; raw
# keeps the features unscaled, raw_target a regression's target, and input_norm puts a BatchNorm1d on the
# inputs first; thin_class0=n keeps one class-0 example in n in every split, sampler="balanced" draws
# batches by WeightedRandomSampler at 1/class count; ordinal fits the class indices with one output by MSE.
SPECS: List[Spec] = [
    # problem  name                                     workload      knobs
    # -- healthy, clean data --------------------------------------------------------------------------------
    S("healthy", "mlp-digits-adamw",                    "classifier", **digits(opt="adamw", lr=1e-3, steps=600)),
    S("healthy", "mlp-digits-sgd-groups",               "classifier", **digits(opt="sgd", lr=0.005, groups="named")),
    S("healthy", "cnn-digits-sgd-groups-dict",          "classifier", **digits(arch="cnn", opt="sgd", lr=0.01,
                                                                                groups="named", format="dict")),
    S("healthy", "logreg-digits-sgd",                   "classifier", **digits(arch="logreg", opt="sgd", lr=0.05)),
    S("healthy", "mlp-breast-cancer-adam-dict",         "classifier", **cancer(opt="adam", lr=1e-3)),
    S("healthy", "mlp-diabetes-regression-adam",        "classifier", **diabetes(opt="adam", lr=1e-3)),
    S("healthy", "bn-mlp-breast-cancer-raw-adam-dict",  "classifier", **cancer(opt="adam", lr=1e-3, raw=True,
                                                                                input_norm=True)),
    S("healthy", "gru-charlm-adamw-dict",               "char_lm",    lr=5e-3, batch=16, steps=150),
    S("healthy", "lora-llama-trainer",                  "lora",       lr=5e-3, batch=16, steps=120),
    S("healthy", "llama-lines-left-padded",             "padded_lm",  lr=3e-3, batch=16, steps=120),
    S("healthy", "mlp-digits-index-batches-adam",       "classifier", **digits(opt="adam", lr=1e-3, format="indexed")),
    S("healthy", "mlp-wine-ordinal-mse-adam",           "classifier", data="wine", arch="mlp", hidden=[32], batch=16,
                                                                      steps=400, opt="adam", lr=1e-3, ordinal=True),
    # -- healthy but noisy: where false alarms come from ---------------------------------------------------
    S("healthy", "mlp-digits-35pct-noisy-labels",       "classifier", **digits(opt="adamw", lr=1e-3, steps=600,
                                                                                label_noise=0.35)),
    S("healthy", "cnn-digits-40pct-noisy-labels-dict",  "classifier", **digits(arch="cnn", opt="sgd", lr=0.005,
                                                                                groups="named", format="dict",
                                                                                label_noise=0.4, steps=250)),
    S("healthy", "mlp-digits-sgd-wd5e-4",               "classifier", **digits(opt="sgd", lr=0.01, weight_decay=5e-4)),
    S("healthy", "mlp-digits-adamw-wd0.1",              "classifier", **digits(opt="adamw", lr=1e-3, weight_decay=0.1)),
    S("healthy", "mlp-digits-batch4-sgd-cosine",        "classifier", **digits(opt="sgd", lr=0.02, batch=4,
                                                                                steps=1200, schedule="cosine",
                                                                                collect_every_n=10)),
    # 800 examples seen once: it stops short of the linear model fitted on all 1000, hence the 0.1 margin
    S("healthy", "mlp-digits-batch-of-one-adam",        "classifier", **digits(opt="adam", lr=2e-3, batch=1, steps=800,
                                                                                collect_every_n=20, margin=0.1)),
    S("healthy", "mlp-breast-cancer-rebalanced-sampler-adam-dict", "classifier", **cancer(opt="adam", lr=5e-4,
                                                                                           thin_class0=6,
                                                                                           sampler="balanced")),
    # -- one planted problem each ----------------------------------------------------------------------------
    S("frozen", "mlp-digits-adam-groups",               "classifier", **digits(opt="adam", lr=1e-3, groups="named")),
    S("lr_zero", "cnn-digits-sgd-groups-dict",          "classifier", **digits(arch="cnn", opt="sgd", lr=0.01,
                                                                                groups="named", backbone_lr=0.0,
                                                                                format="dict")),
    S("misaligned", "mlp-digits-shifted-classes",       "classifier", **digits(opt="adamw", lr=1e-3,
                                                                                variant="shift")),
    S("misaligned", "cnn-digits-permuted-labels-dict",  "classifier", **digits(arch="cnn", opt="adam", lr=1e-3,
                                                                                variant="permute", format="dict")),
    S("overfitting", "mlp256-digits-30-examples",       "classifier", **digits(hidden=[256, 256], opt="adam",
                                                                                lr=3e-3, batch=30, train_size=30,
                                                                                steps=300)),
    S("unscaled_inputs", "mlp-breast-cancer-raw-sgd-dict", "classifier", **cancer(opt="sgd", lr=0.01, raw=True)),
    S("unscaled_inputs", "mlp-breast-cancer-raw-adam",  "classifier", **cancer(opt="adam", lr=1e-3, format="tuple",
                                                                                raw=True)),
    S("unscaled_targets", "mlp-diabetes-raw-target-adam", "classifier", **diabetes(opt="adam", lr=1e-3,
                                                                                raw_target=True)),
    S("unscaled_targets", "mlp-diabetes-raw-target-sgd", "classifier", **diabetes(opt="sgd", lr=1e-3,
                                                                               raw_target=True)),
    S("lr_too_high", "mlp-digits-sgd-lr2",              "classifier", **digits(opt="sgd", lr=2.0)),
    S("lr_too_high", "mlp-diabetes-regression-sgd-lr0.5", "classifier", **diabetes(opt="sgd", lr=0.5)),
    S("nan_input", "mlp-breast-cancer-adam-dict",       "classifier", **cancer(opt="adam", lr=1e-3,
                                                                                bad_step_frac=0.5)),
    S("bad_batch", "mlp-digits-adam-x1000-inputs",      "classifier", **digits(opt="adam", lr=1e-3,
                                                                                bad_step_frac=0.5)),
    S("lr_too_low", "logreg-digits-sgd-lr1e-6",         "classifier", **digits(arch="logreg", opt="sgd", lr=1e-6)),
    S("class_imbalance", "mlp-digits-88pct-class0",     "classifier", **digits(opt="adamw", lr=1e-3,
                                                                                major_share=0.88)),
    S("dead_relu", "mlp-digits-bias-0.8",               "classifier", **digits(opt="adam", lr=1e-3, dead_bias=-0.8)),
    S("saturated", "tanh-mlp3-digits-init-x10",         "classifier", **digits(act="tanh", hidden=[128] * 3,
                                                                                opt="sgd", lr=0.01)),
    S("vanishing", "sigmoid-mlp12-digits",              "classifier", **digits(act="sigmoid", hidden=[64] * 12,
                                                                                opt="sgd", lr=0.05)),
    S("repeated_batch", "mlp-digits-adamw",             "classifier", **digits(opt="adamw", lr=1e-3)),
    S("repeated_batch", "gru-charlm-adamw-dict",        "char_lm",    lr=5e-3, batch=16, steps=100),
    S("labels_not_shifted", "gru-charlm-adamw-dict",    "char_lm",    lr=5e-3, batch=16, steps=150),
    S("shuffled_tokens", "gru-charlm-adamw-dict",       "char_lm",    lr=5e-3, batch=16, steps=150),
    S("padding_read", "llama-lines-left-padded-mask-dropped", "padded_lm", lr=3e-3, batch=16, steps=120),
    S("unshuffled", "mlp-digits-sorted-by-class",       "classifier", **digits(opt="sgd", lr=0.05)),
    S("probability_outputs", "mlp-digits-softmax-ce",   "classifier", **digits(opt="adamw", lr=1e-3,
                                                                                final="softmax")),
    S("probability_outputs", "mlp-breast-cancer-sigmoid-bce-with-logits", "classifier",
      **cancer(opt="adam", lr=1e-3, final="sigmoid")),
    S("grads_never_zeroed", "mlp-digits-sgd",            "classifier", **digits(opt="sgd", lr=0.01)),
    S("grads_never_zeroed", "cnn-digits-adam-dict",     "classifier", **digits(arch="cnn", opt="adam", lr=1e-3,
                                                                                format="dict")),
    S("zero_grad_before_hook", "cnn-digits-adam-dict",  "classifier", **digits(arch="cnn", opt="adam", lr=1e-3,
                                                                                format="dict")),
    S("lora_lr_zero", "lora-llama-trainer",             "lora",       lr=5e-3, lora_lr=0.0, batch=16, steps=60),
    S("not_in_optimizer", "mlp-digits-neck-sgd",        "classifier", **digits(opt="sgd", lr=0.05, neck=64)),
    S("eval_mode", "bn-mlp-breast-cancer-adam-dict",    "classifier", **cancer(opt="adam", lr=1e-3, input_norm=True)),
    S("eval_mode", "bn-mlp-digits-sgd",                 "classifier", **digits(opt="sgd", lr=0.01, input_norm=True)),
    S("negative_loss", "mlp-digits-adam-nll-on-logits", "classifier", **digits(opt="adam", lr=1e-3)),
    S("negative_loss", "cnn-digits-sgd-nll-on-logits-dict", "classifier", **digits(arch="cnn", opt="sgd", lr=0.01,
                                                                                   format="dict")),
    S("holdout_off_scale", "mlp-breast-cancer-raw-holdout-adam-dict", "classifier", **cancer(opt="adam", lr=1e-3)),
    S("holdout_off_scale", "mlp-diabetes-raw-holdout-adam", "classifier", **diabetes(opt="adam", lr=1e-3)),
    S("holdout_leak", "mlp-digits-adamw-holdout-from-train", "classifier", **digits(opt="adamw", lr=1e-3)),
    S("holdout_leak", "mlp-breast-cancer-adam-holdout-from-train-dict", "classifier", **cancer(opt="adam", lr=1e-3)),
    S("constant_inputs", "mlp-digits-adam-floor-div-255", "classifier", **digits(opt="adam", lr=1e-3)),
    S("constant_inputs", "cnn-digits-sgd-floor-div-255-dict", "classifier", **digits(arch="cnn", opt="sgd", lr=0.01,
                                                                                     format="dict")),
    S("over_clipped", "mlp-digits-sgd-clip1e-3",        "classifier", **digits(opt="sgd", lr=0.01, clip=1e-3)),
    S("over_clipped", "cnn-digits-sgd-clip1e-3-dict",   "classifier", **digits(arch="cnn", opt="sgd", lr=0.01,
                                                                                clip=1e-3, format="dict")),
    S("healthy", "mlp-digits-sgd-clip1",                "classifier", **digits(opt="sgd", lr=0.01, clip=1.0)),
    S("weight_decay", "mlp-digits-sgd-wd0.1",           "classifier", **digits(opt="sgd", lr=0.01, weight_decay=0.1)),
    S("weight_decay", "mlp-digits-adam-wd0.1-dict",     "classifier", **digits(opt="adam", lr=1e-3, weight_decay=0.1,
                                                                                format="dict")),
    S("warmup_per_epoch", "mlp-digits-adam-warmup2000", "classifier", **digits(opt="adam", lr=1e-3, schedule="warmup",
                                                                                warmup=2000)),
    S("stale_optimizer", "mlp-digits-adam-model-built-again", "classifier", **digits(opt="adam", lr=1e-3)),
    S("zero_frozen_head", "mlp-digits-adam-head-zeroed-frozen", "classifier", **digits(opt="adam", lr=1e-3)),
    S("zero_frozen_head", "mlp-breast-cancer-sgd-head-zeroed-frozen-dict", "classifier", **cancer(opt="sgd", lr=0.01)),
    S("ema_swap_kept", "mlp-digits-adam-ema-eval", "classifier", **digits(opt="adam", lr=1e-3)),
    S("ema_swap_kept", "cnn-digits-sgd-ema-eval-dict", "classifier", **digits(arch="cnn", opt="sgd", lr=0.05,
                                                                              format="dict")),
]


# ---- One run (in a worker process) ----------------------------------------------------------------------

def _init_worker() -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import logging

    import torch

    torch.set_num_threads(1)  # --jobs processes share the cores; one thread each
    log = logging.getLogger("telemetry")  # alerts are read back from the records, not from the log
    log.addHandler(logging.NullHandler())
    log.propagate = False


def run_one(spec: Spec, seed: int, out_root: str, analyzer: str) -> Dict[str, Any]:
    run_id = f"{spec.name}/s{seed}"
    run_dir = os.path.join(out_root, run_id.replace("/", "__"))
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    result: Dict[str, Any] = {"id": run_id, "problem": spec.problem, "arch": spec.arch, "seed": seed,
                              "run_dir": run_dir, "knobs": spec.knobs}
    started = time.time()
    log = io.StringIO()
    try:
        with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(log), \
                contextlib.redirect_stderr(log):
            warnings.simplefilter("always")
            trained = _train(spec, run_dir, seed)
        result.update(collect_every_n=trained["collect_every_n"], steps=trained["steps"],
                      verified=bool(trained["verdict"].ok), check=trained["verdict"].value,
                      check_detail=trained["verdict"].detail, check_numbers=trained["verdict"].numbers)
        result["telemetry_warnings"] = sorted({str(w.message) for w in caught
                                               if str(w.message).startswith("telemetry")})
    except Exception:
        result.update(verified=False, check="training crashed", train_error=traceback.format_exc())
    result["train_s"] = round(time.time() - started, 2)
    with open(os.path.join(run_dir, "train.log"), "w") as f:
        f.write(log.getvalue())
    result.update(analyze(run_dir, analyzer))
    return result


def _train(spec: Spec, run_dir: str, seed: int) -> Dict[str, Any]:
    sys.path.insert(0, HERE)
    knobs = dict(spec.knobs)
    if spec.workload == "classifier":
        from workloads import train_classifier
        return train_classifier(knobs, run_dir, seed)
    import lm
    return {"char_lm": lm.train_char_lm, "padded_lm": lm.train_padded_lm, "lora": lm.train_lora}[spec.workload](
        knobs, run_dir, seed)


def analyze(run_dir: str, analyzer: str) -> Dict[str, Any]:
    started = time.time()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    try:
        done = subprocess.run([sys.executable, analyzer, run_dir, "--json"], capture_output=True, text=True,
                              timeout=300, env=env)
    except subprocess.TimeoutExpired:
        return {"analyzer_error": "timed out after 300 s", "findings": []}
    out: Dict[str, Any] = {"analyze_s": round(time.time() - started, 2), "analyzer_rc": done.returncode}
    try:
        parsed = json.loads(done.stdout)
        out["findings"] = parsed["findings"]
        out["summary"] = parsed.get("summary")
    except (ValueError, KeyError, TypeError):
        out["findings"] = []
        out["analyzer_error"] = (f"exit {done.returncode}; stderr: {done.stderr.strip()[-1500:]}; "
                                 f"stdout: {done.stdout.strip()[:300]}")
    return out


# ---- Scoring and the table ------------------------------------------------------------------------------

def score(r: Dict[str, Any]) -> Dict[str, Any]:
    alarms = [f["code"] for f in r.get("findings", []) if f.get("severity") in ALARM]
    r["alarms"] = [f"{f['code']}{'[' + f['group'] + ']' if f.get('group') else ''}:{f['severity'][0].upper()}"
                   for f in r.get("findings", []) if f.get("severity") in ALARM]
    if r["problem"] == "healthy":
        r.update(expected=[], named=None, cause_first=None, false_alarm=bool(alarms))
    else:
        named, cause = PROBLEMS[r["problem"]]
        r.update(expected=sorted(named), cause_codes=sorted(cause), named=bool(set(alarms) & named),
                 cause_first=bool(alarms) and alarms[0] in cause, false_alarm=None)
    r["error"] = bool(r.get("train_error") or r.get("analyzer_error"))
    return r


def _yn(v) -> str:
    return "-" if v is None else "yes" if v else "NO"


def table(results: List[Dict[str, Any]]) -> str:
    head = ["run", "verified", "check", "expected", "found (warning/critical, analyzer order)", "named",
            "cause 1st", "false alarm"]
    rows = []
    for r in results:
        found = ", ".join(r["alarms"]) or "-"
        if r.get("analyzer_error"):
            found = "ANALYZER ERROR"
        rows.append([r["id"], "yes" if r["verified"] else "NO", r.get("check", ""),
                     ", ".join(r["expected"]) or "(quiet)", found, _yn(r["named"]), _yn(r["cause_first"]),
                     _yn(r["false_alarm"]) if r["false_alarm"] is not None else "-"])
    widths = [max(len(str(x[i])) for x in rows + [head]) for i in range(len(head))]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths)), "  ".join("-" * w for w in widths)]
    for row in rows:
        lines.append("  ".join(str(v).ljust(w) for v, w in zip(row, widths)).rstrip())
    return "\n".join(lines)


def totals(results: List[Dict[str, Any]]) -> Dict[str, Any]:
    ok = [r for r in results if r["verified"] and not r["error"]]
    healthy = [r for r in ok if r["problem"] == "healthy"]
    planted = [r for r in ok if r["problem"] != "healthy"]
    return {
        "runs": len(results), "verified": len(ok),
        "healthy_quiet": [sum(not r["false_alarm"] for r in healthy), len(healthy)],
        "planted_named": [sum(r["named"] for r in planted), len(planted)],
        "cause_first": [sum(r["cause_first"] for r in planted), len(planted)],
        "false_alarms": [f"{r['id']}: {', '.join(r['alarms'])}" for r in healthy if r["false_alarm"]],
        "misses": [f"{r['id']}: expected {' or '.join(r['expected'])}; found {', '.join(r['alarms']) or 'nothing'}"
                   for r in planted if not r["named"]],
        "named_not_first": [f"{r['id']}: first {r['alarms'][0]}" for r in planted
                            if r["named"] and not r["cause_first"]],
        "not_verified": [f"{r['id']}: {r.get('check_detail') or r.get('check')}" for r in results
                         if not r["verified"] and not r.get("train_error")],
        "telemetry_warnings": [f"{r['id']}: {w}" for r in results for w in r.get("telemetry_warnings", [])],
        "errors": [f"{r['id']}: " + (r.get("train_error") or r.get("analyzer_error")).strip().splitlines()[-1]
                   for r in results if r["error"]],
    }


def format_totals(t: Dict[str, Any]) -> str:
    frac = lambda p: f"{p[0]}/{p[1]}"  # noqa: E731
    out = [f"runs {t['runs']}, label verified {t['verified']} (the totals count verified runs only)",
           f"healthy runs quiet     {frac(t['healthy_quiet'])}",
           f"planted problems named {frac(t['planted_named'])}",
           f"cause first            {frac(t['cause_first'])}"]
    for key, title in (("false_alarms", "false alarms"), ("misses", "misses"),
                       ("named_not_first", "named, but not first"), ("not_verified", "label not verified"),
                       ("telemetry_warnings", "warnings telemetry.py raised while training"),
                       ("errors", "errors (training or analyzer crashed)")):
        out.append(f"{title} ({len(t[key])}):")
        out += [f"  {line}" for line in t[key]] or ["  none"]
    return "\n".join(out)


# ---- Command line ---------------------------------------------------------------------------------------

def matches(run_id: str, patterns: Optional[List[str]]) -> bool:
    """No patterns, or one the run id contains (or matches as a glob)."""
    return not patterns or any(fnmatch.fnmatch(run_id, p) if any(c in p for c in "*?[") else p in run_id
                               for p in patterns)


def select(patterns: Optional[List[str]], seeds: List[int]) -> List[tuple]:
    return [(spec, seed) for spec in SPECS for seed in seeds if matches(f"{spec.name}/s{seed}", patterns)]


COST = {"lora": 4, "char_lm": 4, "padded_lm": 4, "classifier": 1}  # longest first, so the pool finishes together


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="directory for the run directories (each run gets a fresh one)")
    p.add_argument("--rescore", metavar="FILE",
                   help="train nothing: analyze again the run directories a previous --json FILE lists, with their "
                        "labels as verified when they were trained")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--only", nargs="+", metavar="PATTERN",
                   help="run ids (problem/arch/sN) containing PATTERN, or matching it as a glob")
    p.add_argument("--jobs", type=int, default=2, help="worker processes (default 2)")
    p.add_argument("--analyzer", default=os.path.join(REPO, "analyze_telemetry.py"))
    p.add_argument("--json", metavar="FILE", help="write every run, its findings and the totals to FILE")
    args = p.parse_args(argv)
    if args.rescore:
        return rescore(args)
    if not args.out:
        p.error("--out is required (or --rescore FILE)")
    try:
        import sklearn  # noqa: F401  the datasets; not a dependency of the project itself
    except ImportError:
        print("the corpus needs scikit-learn for its datasets: pip install scikit-learn", file=sys.stderr)
        return 2
    todo = select(args.only, args.seeds)
    if not todo:
        print("no run matches", file=sys.stderr)
        return 2
    analyzer = os.path.abspath(args.analyzer)
    os.makedirs(args.out, exist_ok=True)
    started = time.time()
    print(f"{len(todo)} runs, {args.jobs} jobs, analyzer {analyzer}", file=sys.stderr, flush=True)
    order = sorted(range(len(todo)), key=lambda i: -COST[todo[i][0].workload])
    results: List[Optional[Dict[str, Any]]] = [None] * len(todo)
    if args.jobs <= 1:
        _init_worker()
        for n, i in enumerate(order, 1):
            results[i] = run_one(*todo[i], args.out, analyzer)
            _progress(n, len(todo), results[i], started)
    else:
        with ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn"), initializer=_init_worker) as pool:
            futures = {pool.submit(run_one, *todo[i], args.out, analyzer): i for i in order}
            for n, fut in enumerate(as_completed(futures), 1):
                results[futures[fut]] = fut.result()
                _progress(n, len(todo), results[futures[fut]], started)
    report(results, args, analyzer, args.seeds, time.time() - started)
    return 0


def report(results: List[Dict[str, Any]], args, analyzer: str, seeds: List[int], wall: float) -> None:
    """Score the runs, print the table and the totals, and write --json."""
    scored = [score(r) for r in results]
    t = totals(scored)
    print(table(scored))
    print()
    print(format_totals(t))
    print(f"\nwall time {wall:.0f} s for {len(results)} runs with --jobs {args.jobs}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"analyzer": analyzer, "seeds": seeds, "jobs": args.jobs, "wall_s": round(wall, 1),
                       "totals": t, "runs": scored}, f, indent=1, default=str)


def rescore(args) -> int:
    """Analyze the runs of an earlier --json again (a changed analyzer, the same trained runs): the labels
    stay as they were verified at training time, only the findings are new. --only narrows the runs."""
    with open(args.rescore) as f:
        earlier = json.load(f)
    analyzer = os.path.abspath(args.analyzer)
    keep = [r for r in earlier["runs"] if matches(r["id"], args.only)]
    started = time.time()
    with ProcessPoolExecutor(args.jobs) as pool:
        found = list(pool.map(analyze, [r["run_dir"] for r in keep], [analyzer] * len(keep)))
    drop = ("findings", "summary", "analyzer_error", "analyze_s", "analyzer_rc", "alarms", "named", "cause_first",
            "false_alarm", "error", "expected", "cause_codes")
    results = [{**{k: v for k, v in r.items() if k not in drop}, **new} for r, new in zip(keep, found)]
    report(results, args, analyzer, earlier.get("seeds", []), time.time() - started)
    return 0


def _progress(n: int, total: int, r: Dict[str, Any], started: float) -> None:
    print(f"[{n}/{total} {time.time() - started:4.0f}s] {r['id']}: train {r['train_s']}s, "
          f"verified {r['verified']}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
