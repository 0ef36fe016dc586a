"""Tests of analyze_telemetry.py on synthetic runs written here, record by record, per SCHEMA (schema 1).

The healthy generator is meant to look like a real run: a noisy decreasing batch loss, gradient norms
that wobble +-30%, weight deltas that shrink slowly, a 50-example holdout whose accuracy climbs with
noise (each example has a difficulty; the model's skill rises past it), and batches of 32 with binomial
label noise. Each problem scenario bends one part of it.
"""

import csv
import json
import math
import os
import re
import stat
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import analyze_telemetry as at  # noqa: E402

PY = sys.executable
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


# ---- synthetic runs ----------------------------------------------------------------------------------

def healthy_records(n=120, every=10, seed=0, holdout=50, skill=None, loss_level=None, train_acc=None,
                    grad_scale=None, p_class1=0.5, extra=False, lora=False):
    """A list of schema-1 records of a healthy two-group (backbone/head) binary classifier."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 2, holdout)
    difficulty = rng.uniform(0.0, 1.0, holdout)
    skill = skill or (lambda t: 0.5 + 0.45 * (1 - math.exp(-4 * t)))
    loss_level = loss_level or (lambda t: 0.12 + 0.58 * math.exp(-3.5 * t))
    train_acc = train_acc or (lambda t: min(0.99, skill(t) + 0.02))
    grad_scale = grad_scale or (lambda t: 1.0)
    layers = ["backbone.0.weight", "backbone.0.bias", "backbone.3.weight", "head.weight"]
    recs = []
    for i in range(n):
        t = i / (n - 1)
        step = (i + 1) * every
        margins = 4 * (skill(t) - difficulty + rng.normal(0, 0.03, holdout))
        logits = [[0.0, float(m)] if y == 1 else [float(m), 0.0] for m, y in zip(margins, labels)]
        preds = [int(y) if m > 0 else int(1 - y) for m, y in zip(margins, labels)]
        hold_loss = float(np.mean(np.log1p(np.exp(-margins))))
        backbone = 1.0 * (1 - 0.3 * t) * rng.uniform(0.7, 1.3) * grad_scale(t)
        head = 0.3 * rng.uniform(0.7, 1.3) * grad_scale(t)
        ones = int(rng.binomial(32, p_class1))
        lr_factor = 0.5 * (1 + math.cos(math.pi * t)) * 0.95 + 0.05
        rec = {
            "schema": 1, "step": step, "batch_idx": step % 400 or 400, "epoch": (step - 1) // 400,
            "timestamp": f"2026-11-22T02:{10 + i // 60:02d}:{i % 60:02d}.000000",
            "loss": float(loss_level(t) * math.exp(rng.normal(0, 0.2))),
            "train_acc": float(rng.binomial(32, train_acc(t)) / 32),
            "gradient_norm": {"overall": math.hypot(backbone, head), "backbone": backbone, "head": head},
            "weight_delta": ({"overall": None, "backbone": None, "head": None} if i == 0 else
                             {"overall": 0.05 * math.exp(-t) * 1.2, "backbone": 0.05 * math.exp(-t) * rng.uniform(0.9, 1.1),
                              "head": 0.03 * math.exp(-t) * rng.uniform(0.9, 1.1)}),
            "learning_rates": {"overall": 1e-2 * lr_factor, "backbone": 1e-3 * lr_factor, "head": 1e-2 * lr_factor},
            "holdout_logits": {"kind": "classification", "logits": logits, "labels": [int(v) for v in labels],
                               "predictions": preds, "accuracy": float(np.mean(np.equal(preds, labels))),
                               "loss": hold_loss, "num_classes": 2},
            "batch_stats": {"batch_size": 32, "label_key": "winner", "counts": {"0": 32 - ones, "1": ones},
                            "winner_0_pct": 100 * (32 - ones) / 32, "winner_1_pct": 100 * ones / 32},
            "telemetry_ms": float(rng.uniform(2, 4)),
        }
        if extra:
            rec["update_ratio"] = {"overall": 1e-3 * rng.uniform(0.7, 1.3), "backbone": 8e-4 * rng.uniform(0.7, 1.3),
                                   "head": 2e-3 * rng.uniform(0.7, 1.3)}
            rec["weight_norm"] = {"overall": 12.0 + t, "backbone": 11.0 + t, "head": 1.0}
            rec["layer_stats"] = {k: {"grad_norm": float((0.5 + j) * rng.uniform(0.7, 1.3)), "grad_mean": 0.0,
                                      "grad_std": 0.01, "grad_min": -0.1, "grad_max": 0.1, "zeros": 0, "nans": 0,
                                      "infs": 0, "weight_norm": 3.0} for j, k in enumerate(layers)}
            rec["param_change"] = {"l2": 0.05, "l1": 3.0, "max_abs": 0.01, "mean": 0.0, "std": 1e-4,
                                   "sign_flip_fraction": 0.3, "sparsity": {"1e-08": 0.05 + 0.1 * t, "1e-06": 0.2 + 0.2 * t},
                                   "sparsity_rel": {"1e-03": 0.4 + 0.1 * t}}
            rec["sparse_quality"] = {th: {"kl": kl, "cosine": 1 - kl, "mse": kl / 10, "top1_agree": 1 - kl / 2,
                                          "kept_ratio": kr, "random": {"kl": 3 * kl, "cosine": 1 - 3 * kl,
                                                                       "mse": kl / 3, "top1_agree": 1 - 1.5 * kl}}
                                     for th, kl, kr in (("1e-06", 0.01, 0.9), ("1e-04", 0.05, 0.5), ("1e-02", 0.2, 0.1))}
            rec["system"] = {"step_time_s": 0.05 * rng.uniform(0.9, 1.1), "examples_per_s": 640 * rng.uniform(0.9, 1.1),
                             "rss_mb": 900 + i, "telemetry_share": 0.02}
        if lora:
            first = i == 0
            a_grad = 0.0 if first else 0.02 * rng.uniform(0.7, 1.3)   # B is zero-initialised: A's first grad is 0
            rec["lora"] = {"adapter_norm": {"overall": 0.0 if first else 0.01 * (1 + 5 * t), "layer_0": 0.0 if first else 0.005},
                           "adapter_delta": {"overall": None if first else 0.001 * rng.uniform(0.7, 1.3)},
                           "grad_norm_A": a_grad, "grad_norm_B": 0.05 * rng.uniform(0.7, 1.3),
                           "b_zero_fraction": 1.0 if first else 0.0,
                           "stable_rank": {"min": 1.0, "median": 2.0, "max": 3.0}}
            rec["gradient_norm"]["lora_A"] = a_grad
        recs.append(rec)
    return recs


def write_run(path, recs, meta=None, trailing=""):
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    meta = meta or {"schema": 1, "torch_version": "2.13.0", "config": {"collect_every_n": 10}, "starts": ["2026-11-22T02:10:00"],
                    "parameters": {"total": 41410, "trainable": 41410},
                    "groups": {"backbone": {"tensors": 4, "elements": 41152, "names": ["backbone.0.weight"]},
                               "head": {"tensors": 2, "elements": 258, "names": ["head.weight"]}},
                    "optimizer": "AdamW", "world_size": 1, "rank": 0, "holdout": {"examples": 50}}
    (path / "run.json").write_text(json.dumps(meta))
    with open(path / "telemetry.jsonl", "w") as f:
        for r in recs:
            f.write(json.dumps(r, allow_nan=False, separators=(",", ":")) + "\n")
        f.write(trailing)
    return path


def findings_of(path):
    """Every finding of a run, those a root cause explains (its consequences) right after it."""
    run = at.load_run(path, progress=False)
    found = at.diagnose(run)
    # a check that raised is only a notice to users; here it is a bug
    assert not [n for n in run.notices if at.CHECK_FAILED in n], run.notices
    return at.every_finding(found)


def codes(findings, severities=("warning", "critical")):
    return {f.code for f in findings if f.severity in severities}


# Scenarios: each bends the healthy run in one way and must raise (code, severity).

def sc_overfitting(tmp):
    # the holdout peaks at 40% of the run and then slides while the train side keeps improving
    skill = lambda t: 0.5 + 0.4 * min(t / 0.4, 1) - 0.25 * max(0, t - 0.4) / 0.6
    return healthy_records(skill=skill, train_acc=lambda t: min(0.99, 0.6 + 0.5 * t),
                           loss_level=lambda t: 0.7 * math.exp(-4 * t) + 0.005)


def sc_holdout_at_chance(tmp):
    return healthy_records(skill=lambda t: 0.5, train_acc=lambda t: min(0.99, 0.55 + 0.5 * t))


def sc_not_learning(tmp):
    recs = healthy_records(loss_level=lambda t: 0.69)
    for r in recs[1:]:
        r["weight_delta"] = {"overall": 2e-9, "backbone": 1e-9, "head": 1e-9}
    for r in recs:
        del r["holdout_logits"]
    return recs


def sc_exploding_gradients(tmp):
    # the loss climbs back up as the gradients grow (gradients that grow while it keeps falling are learning)
    return healthy_records(grad_scale=lambda t: 10 ** (4 * max(0.0, t - 0.5)),
                           loss_level=lambda t: 0.12 + 0.58 * math.exp(-3.5 * t) + 2 * max(0.0, t - 0.5))


def sc_vanishing_gradients(tmp):
    return healthy_records(grad_scale=lambda t: 10 ** (-6 * t), loss_level=lambda t: 0.6 - 0.1 * t)


def sc_frozen_group(tmp):
    recs = healthy_records()
    for r in recs[1:]:
        r["gradient_norm"]["backbone"] = 0.0
        r["weight_delta"]["backbone"] = 0.0
    return recs


def sc_lr_zero(tmp):
    recs = healthy_records()
    for r in recs:
        r["learning_rates"]["backbone"] = 0.0
    for r in recs[1:]:
        r["weight_delta"]["backbone"] = 0.0
    return recs


def sc_class_imbalance(tmp):
    return healthy_records(p_class1=0.85)


def sc_nonfinite(tmp):
    recs = healthy_records()
    for r in recs[70:]:
        r["loss"] = None
        r["gradient_norm"]["head"] = None
        r["nonfinite"] = ["loss", "gradient_norm.head"]
    return recs


def sc_loss_spike(tmp):
    recs = healthy_records()
    recs[80]["loss"] *= 8
    return recs


def sc_missing_gradients(tmp):
    recs = healthy_records()
    for r in recs:
        r["gradient_norm"] = {"overall": None, "backbone": None, "head": None}
    return recs


def sc_forgetting(tmp):
    skill = lambda t: 0.5 + 0.45 * min(t / 0.6, 1) - 0.4 * max(0, t - 0.7) / 0.3
    return healthy_records(skill=skill)


def sc_lora_not_learning(tmp):
    recs = healthy_records(lora=True)
    for r in recs:
        r["lora"].update({"b_zero_fraction": 1.0, "adapter_norm": {"overall": 0.0}, "grad_norm_A": 0.0})
    return recs


def sc_alert(tmp):
    recs = healthy_records()
    recs[50]["alerts"] = [{"code": "grad_spike", "severity": "warning", "message": "gradient norm 40x its median",
                           "group": "head"}]
    return recs


def sc_metric_errors(tmp):
    recs = healthy_records()
    for r in recs[30:40]:
        del r["batch_stats"]
        r["errors"] = {"batch_stats": "TypeError: unsupported batch type list"}
    return recs


SCENARIOS = {
    "overfitting": (sc_overfitting, "warning"),
    "holdout_at_chance": (sc_holdout_at_chance, "critical"),
    "not_learning": (sc_not_learning, "critical"),
    "exploding_gradients": (sc_exploding_gradients, "warning"),
    "vanishing_gradients": (sc_vanishing_gradients, "warning"),
    "frozen_group": (sc_frozen_group, "critical"),
    "lr_zero": (sc_lr_zero, "critical"),
    "class_imbalance": (sc_class_imbalance, "warning"),
    "nonfinite": (sc_nonfinite, "critical"),
    "loss_spike": (sc_loss_spike, "warning"),
    "missing_gradients": (sc_missing_gradients, "critical"),
    "forgetting": (sc_forgetting, "warning"),
    "lora_not_learning": (sc_lora_not_learning, "critical"),
    "grad_spike": (sc_alert, "info"),   # a telemetry alert keeps its code; a lone grad_spike in a run with no
                                        # blow-up is a note
    "metric_errors": (sc_metric_errors, "warning"),
}


@pytest.fixture(scope="module")
def healthy_full(tmp_path_factory):
    """A healthy run with every optional section (update_ratio, layer_stats, LoRA, system...)."""
    return write_run(tmp_path_factory.mktemp("runs") / "healthy_full", healthy_records(extra=True, lora=True))


@pytest.fixture(scope="module")
def analyzed(healthy_full, tmp_path_factory):
    """The CLI's default output for the full healthy run (plots + report), made once."""
    out = tmp_path_factory.mktemp("analysis")
    proc = subprocess.run([PY, str(ROOT / "analyze_telemetry.py"), str(healthy_full), "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return out, proc.stdout


# ---- diagnosis ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(6))
def test_healthy_runs_have_no_warnings(tmp_path, seed):
    recs = healthy_records(seed=seed, n=60 + 30 * seed, extra=seed % 2 == 1, lora=seed % 3 == 2)
    found = findings_of(write_run(tmp_path / "h", recs))
    bad = [f"{f.severity} {f.code}: {f.message}" for f in found if f.severity != "info"]
    assert not bad, bad


def test_healthy_full_run_has_no_warnings(healthy_full):
    bad = [f"{f.code}: {f.message}" for f in findings_of(healthy_full) if f.severity != "info"]
    assert not bad, bad


@pytest.mark.parametrize("code", sorted(SCENARIOS))
def test_each_finding_code_triggers(tmp_path, code):
    make, severity = SCENARIOS[code]
    found = findings_of(write_run(tmp_path / code, make(tmp_path)))
    match = [f for f in found if f.code == code]
    assert match, f"{code} not found; got {[(f.code, f.severity) for f in found]}"
    f = match[0]
    assert f.severity == severity, (f.severity, f.message)
    assert f.message and f.hint and isinstance(f.steps, list) and f.steps
    assert any(ch.isdigit() for ch in f.message), "the message should carry the numbers that triggered it"


def test_each_check_gives_one_code(tmp_path):
    """Every analyzer check owns one finding code (telemetry's alerts keep the writer's codes)."""
    by_check = {}
    for code, (make, _) in SCENARIOS.items():
        run = at.load_run(write_run(tmp_path / code, make(tmp_path)), progress=False)
        for check in at.CHECKS:
            if check is not at.check_telemetry_alerts:
                by_check.setdefault(check.__name__, set()).update(f.code for f in check(run))
    assert all(len(c) <= 1 for c in by_check.values()), by_check
    owned = [c for codes_ in by_check.values() for c in codes_]
    assert len(owned) == len(set(owned)) and len(owned) >= 14, by_check


def test_finding_details(tmp_path):
    nonfinite = [f for f in findings_of(write_run(tmp_path / "nf", sc_nonfinite(tmp_path))) if f.code == "nonfinite"][0]
    assert nonfinite.steps[0] == 710 and nonfinite.group == "head"
    assert "first at step 710 in loss; also gradient_norm.head" in nonfinite.message   # the loss goes first
    lr = [f for f in findings_of(write_run(tmp_path / "lr", sc_lr_zero(tmp_path))) if f.code == "lr_zero"][0]
    assert lr.group == "backbone" and "frozen_group" not in codes(findings_of(tmp_path / "lr"))
    miss = [f for f in findings_of(write_run(tmp_path / "mg", sc_missing_gradients(tmp_path)))
            if f.code == "missing_gradients"][0]
    assert "zero_grad" in miss.hint
    spike = [f for f in findings_of(write_run(tmp_path / "ls", sc_loss_spike(tmp_path))) if f.code == "loss_spike"][0]
    assert spike.steps == [810]


def test_telemetry_alerts_fold_into_matching_findings(tmp_path):
    recs = sc_lr_zero(tmp_path)
    recs[0]["alerts"] = [{"code": "lr_zero", "severity": "warning", "message": "group 'backbone' has learning rate 0",
                          "group": "backbone"}]
    recs[2]["alerts"] = [{"code": "frozen_group", "severity": "warning", "message": "update exactly 0",
                          "group": "backbone"}]
    found = [f for f in findings_of(write_run(tmp_path / "r", recs)) if f.severity != "info"]
    assert [(f.code, f.severity) for f in found] == [("lr_zero", "critical")]
    assert "telemetry alert lr_zero at step 10" in found[0].message and "frozen_group" in found[0].message


def test_a_lone_gradient_spike_alert_is_a_note_and_one_the_run_confirms_folds(tmp_path):
    """telemetry raises grad_spike live, from a window of the run. Where the whole run shows no gradient
    blow-up (a healthy run's one blip), the analyzer reports it as a note; where exploding_gradients confirms
    it, it folds into that finding."""
    recs = healthy_records()
    recs[60]["alerts"] = [{"code": "grad_spike", "severity": "warning", "message": "gradient norm 3 is 9 robust SDs"}]
    spike = [f for f in findings_of(write_run(tmp_path / "lone", recs)) if f.code == "grad_spike"]
    assert [(f.severity, f.source) for f in spike] == [("info", "telemetry")] and "lone spike" in spike[0].message
    recs = sc_exploding_gradients(tmp_path)
    recs[100]["alerts"] = [{"code": "grad_spike", "severity": "warning", "message": "gradient norm 90"}]
    found = findings_of(write_run(tmp_path / "boom", recs))
    assert "grad_spike" not in {f.code for f in found}
    assert "telemetry alert grad_spike" in next(f for f in found if f.code == "exploding_gradients").message


def test_lone_gradient_jumps_under_a_trainers_clipping_are_no_explosion(tmp_path):
    """A fine-tune late in its run: most batches right (norms near 0.01), a few with one example sharply wrong
    (norms 1000x that, back down at the next collection). The records' norms are taken before the trainer's
    clipping (run.json's clip_grad_norm, as the HF and Lightning callbacks write it), which bounds each of
    those steps: no exploding_gradients, where without clipping the jumps are one."""
    recs = healthy_records()
    for i in (70, 85, 100):
        recs[i]["gradient_norm"] = {k: v * 1000 for k, v in recs[i]["gradient_norm"].items()}
        recs[i]["loss"] *= 3   # the batch the model got wrong
    meta = json.loads((write_run(tmp_path / "plain", recs) / "run.json").read_text())
    plain = next(f for f in findings_of(tmp_path / "plain") if f.code == "exploding_gradients")
    assert "jumped to" in plain.message and "add gradient clipping" in plain.hint
    write_run(tmp_path / "clipped", recs, dict(meta, clip_grad_norm=1.0))
    assert "exploding_gradients" not in {f.code for f in findings_of(tmp_path / "clipped")}


def test_churn_is_no_finding_and_a_small_net_loss_is_info(tmp_path):
    recs = healthy_records()
    # two examples flip once each and come back: forgetting events, but churn, and a healthy run is quiet
    for r in recs[60:62]:
        r["holdout_logits"]["predictions"][0] ^= 1
        r["holdout_logits"]["predictions"][1] ^= 1
    assert "forgetting" not in codes(findings_of(write_run(tmp_path / "churn", recs)), at.SEVERITIES)
    recs = healthy_records()
    always = [i for i in range(50) if all(r["holdout_logits"]["predictions"][i] == r["holdout_logits"]["labels"][i]
                                          for r in recs)]
    for r in recs[-3:]:   # four examples right all along are wrong at the end: 4 lost, 0 regained, z = 2
        for i in always[:4]:
            r["holdout_logits"]["predictions"][i] ^= 1
    found = [f for f in findings_of(write_run(tmp_path / "lost", recs)) if f.code == "forgetting"]
    assert [f.severity for f in found] == ["info"] and "are wrong at the end and 0 the other way" in found[0].message


def test_a_noisy_runs_lucky_best_is_no_forgetting_warning_and_a_decline_amid_the_noise_is(tmp_path):
    """A noisy run (small batches, a high learning rate) passes through many models: from the middle on the
    holdout accuracy swings by about 0.05 around a level it holds, and the examples right at its luckiest
    window and wrong at the end far outnumber the other way round (12 to 0, McNemar z 3.5), yet the end is
    no lower than the swings reach. A warning needs an end below what they explain; the same swings on a
    skill that falls by 0.3 over the last 30% are still a warning."""
    def run(seed, fall):
        wobble = np.random.default_rng(100 + seed).normal(0, 0.05, 120)

        def skill(t):
            return 0.5 + 0.4 * (1 - math.exp(-6 * t)) - fall * max(0, t - 0.7) / 0.3 + (wobble[round(t * 119)]
                                                                                       if t > 0.3 else 0)
        return write_run(tmp_path / f"{seed}-{fall}", healthy_records(holdout=100, skill=skill, seed=seed))

    for seed in (1, 2):
        found = [f for f in findings_of(run(seed, 0.0)) if f.code == "forgetting"]
        assert [f.severity for f in found] == ["info"] and "swings" in found[0].hint, found
        lost, regained = map(int, re.search(r"; (\d+) examples right .* and (\d+) the other", found[0].message).groups())
        assert lost - regained >= 10 and (lost - regained) / math.sqrt(lost + regained) >= 3   # McNemar alone: a warning
        found = [f for f in findings_of(run(seed, 0.3)) if f.code == "forgetting"]
        assert [f.severity for f in found] == ["warning"], found


def test_lora_zero_first_gradient_is_healthy(tmp_path):
    found = findings_of(write_run(tmp_path / "lora", healthy_records(lora=True)))
    assert not codes(found), [(f.code, f.message) for f in found]


def test_first_weight_delta_null_is_not_a_finding(tmp_path):
    found = findings_of(write_run(tmp_path / "r", healthy_records(n=8)))
    assert not codes(found)


def test_loss_spike_rule_is_relative_to_the_run(tmp_path):
    # the same noise pattern scaled by 1000 must give the same verdict (no fixed absolute threshold)
    for scale, name in ((1.0, "a"), (1000.0, "b")):
        recs = sc_loss_spike(tmp_path)
        for r in recs:
            r["loss"] *= scale
        assert "loss_spike" in codes(findings_of(write_run(tmp_path / name, recs)))


def lm_records(n=80, seed=0, overfit=False):
    """A causal-LM fine-tune: per-example holdout NLL / token accuracy, token batch stats, no classes."""
    rng = np.random.default_rng(seed)
    base = rng.uniform(2.0, 4.0, 16)
    recs = []
    for i in range(n):
        t = i / (n - 1)
        # overfit: the holdout improves for a third of the run, then every example's NLL climbs
        shape = (1 - 0.5 * min(t, 1 / 3) * 3 + 1.2 * max(0, t - 1 / 3)) if overfit else (1 - 0.5 * (1 - math.exp(-3 * t)))
        nll = base * shape * np.exp(rng.normal(0, 0.02, 16))
        tok = np.clip(0.9 - 0.2 * nll, 0, 1)
        train = (3.0 * (0.15 if overfit and t > 0.5 else 1) - 1.5 * (1 - math.exp(-3 * t))) * math.exp(rng.normal(0, 0.1))
        g = rng.uniform(0.7, 1.3)
        recs.append({
            "schema": 1, "step": i + 1, "batch_idx": i + 1, "epoch": 0, "timestamp": "2026-11-22T03:00:00",
            "loss": float(max(train, 0.05)),
            "gradient_norm": {"overall": g, "lora_A": 0.0 if i == 0 else 0.3 * g, "lora_B": 0.8 * g},
            "weight_delta": {"overall": None} if i == 0 else {"overall": 0.01, "lora_A": 0.006, "lora_B": 0.008},
            "learning_rates": {"overall": 2e-4, "default": 2e-4},
            "holdout_logits": {"kind": "lm", "nll": [float(v) for v in nll], "token_accuracy": [float(v) for v in tok],
                               "loss": float(nll.mean()), "accuracy": float(tok.mean())},
            "batch_stats": {"batch_size": 8, "tokens": 1024, "label_share": float(rng.uniform(0.4, 0.6)),
                            "padding_share": float(rng.uniform(0.1, 0.2))},
        })
    return recs


def test_language_model_runs(tmp_path):
    healthy = findings_of(write_run(tmp_path / "lm", lm_records(), meta={"schema": 1}))
    assert not codes(healthy), [(f.code, f.message) for f in healthy]
    over = findings_of(write_run(tmp_path / "lm_over", lm_records(overfit=True), meta={"schema": 1}))
    assert "overfitting" in codes(over), [(f.code, f.message) for f in over]
    out = tmp_path / "plots"
    assert at.main([str(tmp_path / "lm"), "--out", str(out)]) == 0
    for name in ("holdout_heatmap.png", "batch_balance.png", "loss.png", "accuracy.png"):
        assert (out / name).read_bytes()[:8] == PNG_SIGNATURE


def test_trainable_tensors_outside_the_optimizer(tmp_path):
    recs = healthy_records(n=40)
    for i, r in enumerate(recs):
        r["gradient_norm"]["not_in_optimizer"] = 0.4
        r["weight_delta"]["not_in_optimizer"] = None if i == 0 else 0.0
        r["learning_rates"]["not_in_optimizer"] = None
    found = [f for f in findings_of(write_run(tmp_path / "r", recs)) if f.severity != "info"]
    assert [(f.code, f.severity, f.group) for f in found] == [("not_in_optimizer", "warning", "not_in_optimizer")]


# ---- reading -----------------------------------------------------------------------------------------

def test_torn_last_line_and_malformed_middle_line(tmp_path, capsys):
    recs = healthy_records(n=30)
    path = write_run(tmp_path / "r", recs, trailing='{"schema":1,"step":310,"loss":0.')
    lines = (path / "telemetry.jsonl").read_text().split("\n")
    lines.insert(10, "{this is not json")
    lines.insert(20, '{"schema":1,"step":999,"loss":NaN}')   # strict JSON: NaN is malformed
    (path / "telemetry.jsonl").write_text("\n".join(lines))
    run = at.load_run(path, progress=False)
    assert len(run.records) == 30
    notes = "\n".join(run.notices)
    assert "line 11" in notes and "line 21" in notes and "torn last line" in notes
    assert at.main([str(path), "--no-plots"]) == 0
    out = capsys.readouterr().out
    assert "line 11: malformed" in out and "torn" in out and "Traceback" not in out


def test_other_schema_and_missing_sections(tmp_path):
    recs = [{"schema": 2, "batch_idx": 10 * i, "epoch": 0, "timestamp": "2026-11-22T02:00:00",
             "loss": 0.7 - 0.01 * i, "new_section": {"x": 1}} for i in range(1, 20)]
    run = at.load_run(write_run(tmp_path / "r", recs, meta={}), progress=False)
    assert len(run.records) == 19 and [r["step"] for r in run.records][:3] == [1, 2, 3]
    assert any("schema 2" in n for n in run.notices)
    at.diagnose(run)   # no exception with most sections absent
    assert at.summarize(run)["records"] == 19


# ---- command line ------------------------------------------------------------------------------------

def test_plots_are_nonempty_pngs(analyzed):
    out, stdout = analyzed
    import matplotlib.image as mpimg
    expected = ["loss.png", "accuracy.png", "gradient_norm.png", "weight_delta.png", "learning_rate.png",
                "batch_balance.png", "holdout_heatmap.png", "update_ratio.png", "layer_grad_heatmap.png", "lora.png",
                "param_change_sparsity.png", "sparse_quality.png", "system.png"]
    for name in expected:
        p = out / name
        assert p.is_file(), name
        data = p.read_bytes()
        assert data[:8] == PNG_SIGNATURE and len(data) > 10_000, name
        assert mpimg.imread(str(p))[..., :3].std() > 0.05, f"{name} looks blank"
    assert str(out / "report.html") in stdout


def test_absent_plot_is_skipped_with_a_reason(tmp_path, capsys):
    recs = healthy_records(n=20)
    for r in recs:
        del r["batch_stats"]
    path = write_run(tmp_path / "r", recs)
    assert at.main([str(path)]) == 0
    out = capsys.readouterr().out
    skipped = [line for line in out.splitlines() if line.startswith("skipped")]
    assert len(skipped) == 1, skipped   # one line, naming what would enable each plot
    assert re.match(r"skipped \d+ plots: ", skipped[0])
    assert "batch_balance (track_batch_stats: true, batch= in on_batch_end)" in skipped[0]
    assert "lora (a model with LoRA adapters)" in skipped[0] and "layer_grad_heatmap (track_layer_stats: true)" in skipped[0]
    report = (path / "analysis" / "report.html").read_text()
    assert "batch_balance.png: no batch_stats in any record; to draw it: track_batch_stats: true" in report
    assert not (path / "analysis" / "batch_balance.png").exists()
    assert (path / "analysis" / "gradient_norm.png").exists() and (path / "analysis" / "report.html").exists()


def test_report_is_self_contained(analyzed):
    out, _ = analyzed
    text = (out / "report.html").read_text()
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", text, re.I)
    assert text.count("data:image/png;base64,") == 13
    assert "No findings" in text or "info" in text


def test_check_exit_codes(tmp_path):
    healthy = write_run(tmp_path / "healthy", healthy_records())
    broken = write_run(tmp_path / "broken", sc_lr_zero(tmp_path))
    script = str(ROOT / "analyze_telemetry.py")
    ok = subprocess.run([PY, script, str(healthy), "--check"], capture_output=True, text=True, timeout=60)
    bad = subprocess.run([PY, script, str(broken), "--check"], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert bad.returncode == 1 and "lr_zero" in bad.stdout
    assert not (healthy / "analysis").exists()   # --check alone writes no plots
    missing = subprocess.run([PY, script, str(tmp_path / "nope")], capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    # a file that is not telemetry.jsonl is named, not taken for the directory it sits in
    (tmp_path / "notes.txt").write_text("x")
    other = subprocess.run([PY, script, str(tmp_path / "notes.txt")], capture_output=True, text=True, timeout=60)
    assert other.returncode == 2 and "notes.txt is not a run directory" in other.stderr


def test_a_reader_that_goes_away_gets_no_traceback(tmp_path):
    """analyze_telemetry.py run... | head: the pipe closes before the output is all written, and the rest is
    dropped quietly, as other command-line tools do."""
    runs = [str(write_run(tmp_path / f"r{k}", healthy_records(seed=k))) for k in range(3)]
    proc = subprocess.Popen([PY, str(ROOT / "analyze_telemetry.py"), *runs, "--no-plots"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()  # gone before the first line: its write fails, whenever it comes
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 1 and "Traceback" not in err and "BrokenPipe" not in err, err


def test_json_output(tmp_path, capsys):
    path = write_run(tmp_path / "r", sc_class_imbalance(tmp_path))
    assert at.main([str(path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["summary"]["records"] == 120
    f = [f for f in data["findings"] if f["code"] == "class_imbalance"][0]
    assert set(f) >= {"code", "severity", "message", "steps", "hint"} and f["severity"] == "warning"


def test_json_and_check_work_without_matplotlib(tmp_path):
    path = write_run(tmp_path / "r", healthy_records(n=30))
    code = ("import sys; sys.modules['matplotlib'] = None; sys.path.insert(0, %r); import analyze_telemetry as a; "
            "rc = a.main([%r, '--json', '--check']); assert 'matplotlib' not in sys.modules or "
            "sys.modules['matplotlib'] is None; sys.exit(rc)") % (str(ROOT), str(path))
    proc = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["summary"]["records"] == 30


def test_analyzer_does_not_import_telemetry():
    src = (ROOT / "analyze_telemetry.py").read_text()
    assert not re.search(r"^\s*(import telemetry|from telemetry import)", src, re.M)


def test_csv_round_trip(tmp_path):
    recs = healthy_records(n=25, extra=True)
    recs[3]["nonfinite"] = ["loss"]
    recs[3]["loss"] = None
    path = write_run(tmp_path / "r", recs)
    out = tmp_path / "run.csv"
    assert at.main([str(path), "--csv", str(out)]) == 0
    with open(out, newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 25
    cols = rows[0].keys()
    assert {"step", "loss", "gradient_norm.head", "holdout_logits.accuracy", "batch_stats.counts.1",
            "layer_stats.head.weight.grad_norm"} <= set(cols)
    assert not any(c.startswith(("holdout_logits.logits", "holdout_logits.labels", "nonfinite")) for c in cols)
    for row, rec in zip(rows, recs):
        assert int(row["step"]) == rec["step"]
        assert float(row["gradient_norm.head"]) == rec["gradient_norm"]["head"]
        assert float(row["holdout_logits.accuracy"]) == rec["holdout_logits"]["accuracy"]
        assert (row["loss"] == "") if rec["loss"] is None else float(row["loss"]) == rec["loss"]
    assert rows[0]["weight_delta.head"] == ""   # null on the first collection stays empty


def test_to_dataframe_with_pandas(tmp_path):
    pd = pytest.importorskip("pandas")
    recs = healthy_records(n=10)
    df = at.to_dataframe(write_run(tmp_path / "r", recs))
    assert isinstance(df, pd.DataFrame) and len(df) == 10 and "holdout_logits.accuracy" in df.columns
    assert list(df.columns[:3]) == ["run", "schema", "step"] and set(df["run"]) == {"r"}
    assert list(df["gradient_norm.backbone"]) == [r["gradient_norm"]["backbone"] for r in recs]


def test_compare_runs(tmp_path, capsys):
    a = write_run(tmp_path / "a" / "run", healthy_records(n=40))
    b = write_run(tmp_path / "b" / "run", sc_overfitting(tmp_path)[:80])
    out = tmp_path / "cmp"
    assert at.main([str(a), str(b), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "Comparison" in text and "holdout accuracy, end" in text and "a/run" in text and "b/run" in text
    assert (out / "gradient_norm.png").is_file() and (out / "report.html").is_file()
    html_text = (out / "report.html").read_text()
    assert "a/run" in html_text and "b/run" in html_text


def test_tensorboard_export_or_skip(tmp_path, capsys):
    path = write_run(tmp_path / "r", healthy_records(n=10))
    assert at.main([str(path), "--no-plots", "--tensorboard", str(tmp_path / "tb")]) == 0
    out = capsys.readouterr().out
    assert "skipped --tensorboard" in out or ("TensorBoard" in out and any((tmp_path / "tb").rglob("events*")))


def test_watch_follows_a_growing_file(tmp_path):
    recs = healthy_records(n=60)
    for r in recs[40:]:
        r["learning_rates"]["backbone"] = 0.0   # the problem starts two thirds in
    path = write_run(tmp_path / "r", recs[:20])
    done = threading.Event()

    def writer():
        time.sleep(1.0)
        with open(path / "telemetry.jsonl", "a") as f:
            for r in recs[20:]:
                line = json.dumps(r) + "\n"
                f.write(line[:15])          # a line arrives in two pieces: never read half of it
                f.flush()
                time.sleep(0.01)
                f.write(line[15:])
                f.flush()
                time.sleep(0.04)
        done.set()

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    proc = subprocess.run([PY, str(ROOT / "analyze_telemetry.py"), str(path), "--watch", "--interval", "0.3",
                           "--max-seconds", "6", "--no-plots"], capture_output=True, text=True, timeout=60)
    thread.join(5)
    assert done.is_set()
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.count("CRITICAL lr_zero:") == 1, out   # told in full once; progress lines name it after that
    assert re.search(r"^\[r\] step 600  loss \S+  holdout acc 0\.\d+  holdout loss \S+ \| newest finding: CRITICAL lr_zero$",
                     out, re.M), out
    assert "malformed" not in out and "torn" not in out
    assert "watched 60 records" in out


def test_watch_writes_report_and_ends_on_ctrl_c(tmp_path):
    path = write_run(tmp_path / "r", healthy_records(n=20))
    # Ctrl-C's default disposition in the child, as in a terminal: a shell's background job (and whatever it
    # starts) ignores SIGINT, and Python then never turns it into KeyboardInterrupt.
    proc = subprocess.Popen([PY, str(ROOT / "analyze_telemetry.py"), str(path), "--watch", "--interval", "0.5"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 60
    while time.time() < deadline and not (path / "analysis" / "report.html").exists():
        time.sleep(0.2)
    time.sleep(0.3)
    proc.send_signal(2)   # SIGINT, as Ctrl-C
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "stopped watching" in out and "Traceback" not in err
    assert (path / "analysis" / "report.html").exists()


# ---- what a run directory from elsewhere, or a bad output path, must not do ------------------------------

def test_links_and_fifos_in_the_analysis_folder_are_never_written_through_or_waited_on(tmp_path):
    """A run received from someone else may carry links and FIFOs in its analysis folder: the analyzer
    writes no file outside the run and does not wait on a FIFO (a subprocess, so a hang fails the test)."""
    path = write_run(tmp_path / "r", healthy_records(n=20))
    analysis = path / "analysis"
    analysis.mkdir()
    victims = [tmp_path / "victim1.txt", tmp_path / "victim2.txt"]
    for v in victims:
        v.write_text("precious")
    (analysis / "report.html.tmp").symlink_to(victims[0])
    (analysis / "loss.png.tmp").symlink_to(victims[1])
    os.mkfifo(analysis / "report.html")
    os.mkfifo(analysis / "gradient_norm.png")
    proc = subprocess.run([PY, str(ROOT / "analyze_telemetry.py"), str(path)], capture_output=True, text=True,
                          timeout=90)
    assert proc.returncode == 0, proc.stderr
    assert [v.read_text() for v in victims] == ["precious", "precious"]
    for name in ("report.html", "loss.png", "gradient_norm.png"):
        assert stat.S_ISREG(os.lstat(analysis / name).st_mode), name
    assert not list(analysis.glob("*.tmp"))
    assert (analysis / "loss.png").read_bytes()[:8] == PNG_SIGNATURE

    # The analysis folder itself a link out of the run: refused, nothing written there.
    other = write_run(tmp_path / "linked", healthy_records(n=20))
    outside = tmp_path / "outside"
    outside.mkdir()
    (other / "analysis").symlink_to(outside)
    proc = subprocess.run([PY, str(ROOT / "analyze_telemetry.py"), str(other)], capture_output=True, text=True,
                          timeout=90)
    assert proc.returncode == 2 and "symbolic link" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert "Run linked" in proc.stdout and not list(outside.iterdir())


def test_a_dollar_in_a_name_draws_every_plot(tmp_path, capsys):
    """Group, class, layer and metric names (and a run's name) are any text: a `$` is drawn as a dollar, not
    read as math text."""
    recs = healthy_records(n=30, extra=True)
    rename = {"backbone": "cost$^$", "head": "head_$lr"}
    for r in recs:
        for section in ("gradient_norm", "weight_delta", "learning_rates", "update_ratio", "weight_norm"):
            r[section] = {rename.get(k, k): v for k, v in r[section].items()}
        r["layer_stats"] = {"$" + k: v for k, v in r["layer_stats"].items()}
        r["system"]["cost_$"] = 1.0
        r["batch_stats"]["counts"] = {"$" + k: v for k, v in r["batch_stats"]["counts"].items()}
    path = write_run(tmp_path / "r$1", recs)
    assert at.main([str(path)]) == 0
    captured = capsys.readouterr()
    assert "failed" not in captured.out and "ParseSyntaxException" not in captured.out + captured.err
    for name in ("gradient_norm.png", "weight_delta.png", "learning_rate.png", "update_ratio.png",
                 "batch_balance.png", "layer_grad_heatmap.png", "system.png"):
        assert (path / "analysis" / name).is_file(), name
    # two runs: the run's name is in every label
    second = write_run(tmp_path / "r$2", recs)
    assert at.main([str(path), str(second), "--out", str(tmp_path / "cmp")]) == 0
    assert "failed" not in capsys.readouterr().out
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots()
    ax.plot([0, 1], [0, 1], label=at._plain("cost$^$"))
    legend = ax.legend()
    fig.canvas.draw()
    assert legend.get_texts()[0].get_text() == at._plain("cost$^$")
    plt.close(fig)


def test_outputs_that_cannot_be_written_are_one_message_and_exit_2(tmp_path, capsys):
    """The diagnosis is printed, then one line names the path and why, and the exit status is 2 (1 is
    --check's critical finding)."""
    path = write_run(tmp_path / "r", healthy_records(n=20))
    (tmp_path / "afile").write_text("x")
    (tmp_path / "adir").mkdir()
    cases = [([str(path), "--out", str(tmp_path / "afile")], "Not a directory"),
             ([str(path), "--csv", str(tmp_path / "adir"), "--check"], "Is a directory"),
             ([str(path), "--csv", str(tmp_path / "nope" / "x.csv"), "--check"], "No such file or directory")]
    for argv, why in cases:
        assert at.main(argv) == 2, argv
        out, err = capsys.readouterr()
        assert out.startswith("Run r "), out
        assert err.startswith("error: cannot write") and why in err and err.count("\n") == 1, err
    # the default folder not writable (here: a file stands at its name, as on a read-only run)
    (path / "analysis").write_text("x")
    assert at.main([str(path), "--check", "--plots"]) == 2
    out, err = capsys.readouterr()
    assert out.startswith("Run r ") and str(path / "analysis") in err and "--out DIR" in err, err
    for interval in ("-1", "0", "nan"):
        with pytest.raises(SystemExit) as exc:
            at.main([str(path), "--watch", "--interval", interval])
        assert exc.value.code == 2 and "argument --interval" in capsys.readouterr().err


def test_check_refuses_a_run_with_no_readable_record(tmp_path, capsys):
    empty = write_run(tmp_path / "empty", [])
    garbage = write_run(tmp_path / "garbage", [], trailing="\x00not json\n{\"step\": 1, \"lo")
    for path in (empty, garbage):
        assert at.main([str(path), "--check"]) == 2
        out, err = capsys.readouterr()
        assert "0 records" in out and "nothing to judge" in err, err
        assert at.main([str(path), "--no-plots"]) == 0   # without --check: the friendly summary
        assert "No records to judge yet" in capsys.readouterr().out
    healthy = write_run(tmp_path / "healthy", healthy_records(n=20))
    assert at.main([str(healthy), str(empty), "--check"]) == 2


def test_a_single_record_run_says_what_its_plots_need(tmp_path, capsys):
    """One collection cannot show a change or a series: the switches are on, so the skip says what is
    missing, and no matplotlib warning reaches the terminal."""
    rec = healthy_records(n=3)[0]
    rec["update_ratio"] = {"overall": None, "backbone": None, "head": None}
    rec["batch_stats"]["counts"] = {str(c): 3 + c for c in range(10)}   # ten classes: a heatmap
    path = write_run(tmp_path / "r", [rec])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert at.main([str(path)]) == 0
    assert not caught, [str(w.message) for w in caught]
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("skipped"))
    assert "weight_delta (needs two collections" in line and "update_ratio (needs two collections" in line, line
    assert "holdout_heatmap (needs two collections" in line, line
    assert "track_weight_delta" not in line and "set_holdout_data" not in line and "track_update_ratio" not in line
    assert (path / "analysis" / "batch_balance.png").is_file()
