"""Training dynamics (issue 5): each number against a reference the test computes itself.

Per-layer statistics against torch reductions on cloned gradients, update ratio and drift against weight
copies, parameter-change statistics against numpy, sparse quality against a model copy holding the previous
weights, alerts on planted spikes/NaNs and none on healthy runs, add_metric isolation, presets via YAML.
"""

import copy
import json
import logging
import math
import os

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

import telemetry
from telemetry import TelemetryConfig, TrainingTelemetry

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GRAD_KEYS = ("grad_norm", "grad_mean", "grad_std", "grad_min", "grad_max", "zeros", "nans", "infs")


def config(run_dir, **overrides):
    base = dict(output_dir=str(run_dir), collect_every_n=1, strict=True)
    return TelemetryConfig(**{**base, **overrides})


def records(run_dir):
    with open(os.path.join(run_dir, "telemetry.jsonl")) as f:
        return [json.loads(line) for line in f]


def snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def norm(tensors):
    return math.sqrt(sum(float(t.double().square().sum()) for t in tensors))


class Blocks(nn.Module):
    """Layers named like a block stack: embed, blocks.0, blocks.1, an unused layer (no gradient), head."""

    def __init__(self, dropout=0.0):
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Dropout(dropout))
                                     for _ in range(2)])
        self.unused = nn.Linear(16, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


LAYERS = {"embed": ["embed.weight", "embed.bias"], "blocks.0": ["blocks.0.0.weight", "blocks.0.0.bias"],
          "blocks.1": ["blocks.1.0.weight", "blocks.1.0.bias"], "unused": ["unused.weight", "unused.bias"],
          "head": ["head.weight", "head.bias"]}


def backward(model, seed=0, n=32):
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, 8, generator=gen), torch.randint(0, 3, (n,), generator=gen)
    loss = F.cross_entropy(model(x.to(next(model.parameters()).dtype)).float(), y)
    loss.backward()
    return loss


# ---- presets ---------------------------------------------------------------------------------------


def test_presets_from_yaml_classmethods_and_overrides(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text("telemetry:\n  preset: comprehensive\n  track_sparse_quality: false\n  collect_every_n: 7\n")
    cfg = TelemetryConfig.from_yaml(str(path), output_dir=str(tmp_path / "a"))
    assert (cfg.track_layer_stats, cfg.track_param_change, cfg.track_update_ratio, cfg.track_system) == (
        True, True, True, True)
    assert cfg.track_sparse_quality is False and cfg.collect_every_n == 7  # keys override the preset
    path.write_text("preset: minimal\n")
    cfg = TelemetryConfig.from_yaml(str(path), output_dir=str(tmp_path / "b"))
    assert not (cfg.track_weight_delta or cfg.track_update_ratio or cfg.track_holdout_logits
                or cfg.track_layer_stats or cfg.track_param_change or cfg.track_sparse_quality)
    assert cfg.track_gradients and cfg.track_learning_rates and cfg.alerts
    assert TelemetryConfig.from_dict({"preset": "default", "output_dir": str(tmp_path)}) == TelemetryConfig(
        output_dir=str(tmp_path))
    assert TelemetryConfig.comprehensive(collect_every_n=3).collect_every_n == 3
    assert TelemetryConfig.minimal(track_update_ratio=True).track_update_ratio is True
    with pytest.raises(ValueError, match="preset"):
        TelemetryConfig.from_dict({"preset": "everything"})
    with pytest.raises(ValueError, match="layer_stats_by"):
        TelemetryConfig(layer_stats_by="module")
    with pytest.raises(ValueError, match="param_change_thresholds"):
        TelemetryConfig(param_change_thresholds=[-1.0])


def test_minimal_preset_keeps_no_weight_reference(tmp_path):
    model = Blocks()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tel = TrainingTelemetry(TelemetryConfig.minimal(output_dir=str(tmp_path), collect_every_n=1, strict=True))
    for step in range(3):
        backward(model, step)
        opt.step()
        rec = tel.on_batch_end(model, opt, step, 0)
        opt.zero_grad()
    assert not os.path.exists(tmp_path / "last_checkpoint.safetensors")
    assert not os.path.exists(tmp_path / "initial_weights.safetensors")
    assert "update_ratio" not in rec and "weight_delta" not in rec and rec["gradient_norm"]["overall"] > 0


# ---- per-layer statistics --------------------------------------------------------------------------


@pytest.mark.parametrize("by", ["tensor", "layer"])
def test_layer_stats_match_torch_reductions_on_cloned_gradients(tmp_path, by):
    torch.manual_seed(0)
    model = Blocks()
    backward(model)
    model.head.weight.grad[0].zero_()  # planted exact zeros
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    weights = snapshot(model)
    tel = TrainingTelemetry(config(tmp_path, track_layer_stats=True, layer_stats_by=by))
    stats = tel.on_batch_end(model, None, 0, 0)["layer_stats"]
    rows = {n: [n] for n in weights} if by == "tensor" else LAYERS
    assert set(stats) == set(rows)
    for row, members in rows.items():
        assert stats[row]["weight_norm"] == pytest.approx(norm([weights[m] for m in members]), rel=1e-5)
        present = [grads[m].reshape(-1) for m in members if m in grads]
        if not present:  # the unused layer has no gradient: null, not zero
            assert all(stats[row][k] is None for k in GRAD_KEYS)
            continue
        flat = torch.cat(present).double()
        assert stats[row]["grad_norm"] == pytest.approx(float(torch.linalg.vector_norm(flat)), rel=1e-5)
        assert stats[row]["grad_mean"] == pytest.approx(float(flat.mean()), rel=1e-5, abs=1e-9)
        assert stats[row]["grad_std"] == pytest.approx(float(flat.std(correction=0)), rel=1e-4)
        assert stats[row]["grad_min"] == pytest.approx(float(flat.min()), rel=1e-6)
        assert stats[row]["grad_max"] == pytest.approx(float(flat.max()), rel=1e-6)
        assert stats[row]["zeros"] == int((flat == 0).sum())
        assert stats[row]["nans"] == 0 and stats[row]["infs"] == 0
    head = stats["head"] if by == "layer" else stats["head.weight"]
    assert head["zeros"] >= 16


def test_nonfinite_params_are_named_counted_and_alerted_once(tmp_path, caplog):
    torch.manual_seed(0)
    model = Blocks()
    backward(model)
    tel = TrainingTelemetry(config(tmp_path, track_layer_stats=True))
    assert "alerts" not in tel.on_batch_end(model, None, 0, 0)  # healthy: W_0 is finite
    model.blocks[0][0].weight.grad[0, 0] = float("nan")
    model.blocks[0][0].weight.grad[1, 0] = float("inf")
    with torch.no_grad():
        good_bias = model.head.bias[1].item()
        model.head.bias[1] = float("inf")
    with caplog.at_level(logging.WARNING, logger="telemetry"):
        rec = tel.on_batch_end(model, None, 0, 0)
    assert rec["nonfinite_params"] == ["blocks.0.0.weight", "head.bias"]
    assert (rec["layer_stats"]["blocks.0"]["nans"], rec["layer_stats"]["blocks.0"]["infs"]) == (1, 1)
    assert rec["layer_stats"]["head"]["nans"] == 0 and rec["layer_stats"]["head"]["weight_norm"] is None
    (alert,) = [a for a in rec["alerts"] if a["code"] == "nonfinite"]
    assert alert["severity"] == "critical" and "blocks.0.0.weight" in alert["message"]
    assert any("nonfinite" in r.getMessage() for r in caplog.records if r.name == "telemetry")
    again = tel.on_batch_end(model, None, 0, 0)  # still broken: written once, when it starts
    assert "nonfinite" not in [a["code"] for a in again.get("alerts", [])]
    with torch.no_grad():
        model.head.bias[1] = good_bias
    model.zero_grad()
    backward(model, seed=1)
    tel.on_batch_end(model, None, 0, 0)  # its weight delta still starts from the Inf reference
    healed = tel.on_batch_end(model, None, 0, 0)
    assert "nonfinite_params" not in healed and "alerts" not in healed and "nonfinite" not in healed
    model.head.weight.grad[0, 0] = float("nan")
    broken = tel.on_batch_end(model, None, 0, 0)
    assert broken["nonfinite_params"] == ["head.weight"]
    assert [a["code"] for a in broken["alerts"]] == ["nonfinite"]


# ---- update ratio, drift, weight norm --------------------------------------------------------------


def test_update_ratio_drift_and_weight_norm_match_weight_copies(tmp_path, pass_threads):
    torch.manual_seed(0)
    model = Blocks()
    body = [n for n in snapshot(model) if not n.startswith("head")]
    groups = {"body": body, "head": ["head.weight", "head.bias"], "overall": list(snapshot(model))}
    named = dict(model.named_parameters())
    opt = torch.optim.AdamW([{"params": [named[n] for n in body], "lr": 1e-3, "name": "body"},
                             {"params": model.head.parameters(), "lr": 1e-2, "name": "head"}])
    cfg = config(tmp_path, collect_every_n=3)
    tel = TrainingTelemetry(cfg)
    w0 = previous = None
    checked = 0

    def check(rec, now):
        for g, names in groups.items():
            assert rec["weight_norm"][g] == pytest.approx(norm([now[n] for n in names]), rel=1e-5)
            assert rec["drift"][g] == pytest.approx(norm([now[n] - w0[n] for n in names]), rel=1e-4, abs=1e-7)
            if previous is None:
                assert rec["update_ratio"][g] is None
            else:
                want = norm([now[n] - previous[n] for n in names]) / norm([now[n] for n in names])
                assert rec["update_ratio"][g] == pytest.approx(want, rel=1e-4)

    for step in range(1, 10):
        backward(model, step)
        opt.step()
        rec = tel.on_batch_end(model, opt, step, 0)
        opt.zero_grad()
        if step == 1:  # W_0 is taken at the hook's first call
            w0 = snapshot(model)
            initial_stat = os.stat(tmp_path / "initial_weights.safetensors")
        if rec is not None:
            now = snapshot(model)
            check(rec, now)
            checked += 1
            previous = now
    assert checked == 3 and 1e-5 < rec["update_ratio"]["body"] < 1e-1
    assert os.stat(tmp_path / "initial_weights.safetensors").st_mtime_ns == initial_stat.st_mtime_ns
    from safetensors.torch import load_file  # the file is plain safetensors, W_0 exactly
    on_disk = load_file(str(tmp_path / "initial_weights.safetensors"))
    assert all(torch.equal(on_disk[n], w0[n]) for n in w0)
    tel.close()
    resumed = TrainingTelemetry(cfg)  # a resumed run keeps measuring drift from the same W_0
    backward(model, 99)
    opt.step()
    rec = resumed.on_batch_end(model, opt, 12, 0)
    check(rec, snapshot(model))


def test_zero_weights_give_a_null_ratio_not_an_infinity(tmp_path):
    model = Blocks()
    with torch.no_grad():
        model.unused.weight.zero_()
        model.unused.bias.zero_()
    opt = torch.optim.SGD([{"params": [p for n, p in model.named_parameters() if "unused" not in n], "name": "body"},
                           {"params": list(model.unused.parameters()), "lr": 0.0, "name": "still"}], lr=0.1)
    tel = TrainingTelemetry(config(tmp_path, groups={"body": ["embed", "blocks", "head"], "zero": ["unused"]}))
    for step in range(2):
        backward(model, step)
        opt.step()  # the unused layer's learning rate is 0: it stays exactly 0
        rec = tel.on_batch_end(model, opt, step, 0)
        opt.zero_grad()
    assert rec["weight_norm"]["zero"] == 0.0 and rec["update_ratio"]["zero"] is None
    assert rec["update_ratio"]["body"] > 0 and "nonfinite" not in rec


def test_one_streamed_pass_serves_every_weight_section(tmp_path, monkeypatch):
    """The default-on update ratio must not add a pass: each reference file is streamed once per collection."""
    opened = []
    real = telemetry._KeptMaps.map

    def counting(self, path, names):
        opened.append(os.path.basename(path))
        return real(self, path, names)

    # Every read of a reference in a collection goes through the store's maps, so counting them finds a second pass.
    monkeypatch.setattr(telemetry._KeptMaps, "map", counting)
    model = Blocks()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tel = TrainingTelemetry(config(tmp_path, track_param_change=True))
    for step in range(3):
        backward(model, step)
        opt.step()
        opened.clear()
        rec = tel.on_batch_end(model, opt, step, 0)
        opt.zero_grad()
    assert sorted(opened) == ["initial_weights.safetensors", "last_checkpoint.safetensors"]
    for key in ("weight_delta", "update_ratio", "drift", "weight_norm", "param_change"):
        assert key in rec
    assert rec["update_ratio"]["overall"] == pytest.approx(
        rec["weight_delta"]["overall"] / rec["weight_norm"]["overall"], rel=1e-6)
    assert rec["param_change"]["l2"] == pytest.approx(rec["weight_delta"]["overall"], rel=1e-5)


# ---- parameter-change statistics -------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(d, d) for _ in range(4))
        self.up_proj, self.down_proj = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, h):
        att = torch.softmax(self.q_proj(h) @ self.k_proj(h).transpose(-1, -2) / 8 ** 0.5, -1) @ self.v_proj(h)
        h = h + self.o_proj(att)
        return h + self.down_proj(F.gelu(self.up_proj(h)))


class TinyTransformer(nn.Module):
    def __init__(self, blocks=2):
        super().__init__()
        self.in_proj = nn.Linear(4, 8)
        self.layers = nn.ModuleList([Block() for _ in range(blocks)])
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        h = self.in_proj(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h.mean(1))


@pytest.mark.parametrize("blocks", [2, 4])
def test_param_change_statistics_match_numpy(tmp_path, pass_threads, blocks):
    """Four blocks hold 16 attention weights of one shape and 16 biases of another: each is measured as one
    stack (telemetry.MIN_STACKED), the rest tensor by tensor."""
    torch.manual_seed(0)
    model = TinyTransformer(blocks)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    thresholds, rel = [1e-8, 1e-4, 1e-3], [1e-3, 1e-1]
    tel = TrainingTelemetry(config(tmp_path, track_param_change=True, param_change_thresholds=thresholds,
                                   param_change_rel_thresholds=rel))

    def step(seed, freeze_rows=False):
        gen = torch.Generator().manual_seed(seed)
        F.cross_entropy(model(torch.randn(16, 5, 4, generator=gen)),
                        torch.randint(0, 3, (16,), generator=gen)).backward()
        if freeze_rows:  # exactly-zero updates for half the rows of a q_proj: sparsity must see them
            model.layers[0].q_proj.weight.grad[:4].zero_()
        opt.step()
        rec = tel.on_batch_end(model, opt, seed, 0)
        opt.zero_grad()
        return rec

    assert "param_change" not in step(0)  # no reference yet
    prev = {n: p.numpy().copy() for n, p in snapshot(model).items()}
    rec = step(1, freeze_rows=True)
    now = {n: p.numpy().copy() for n, p in snapshot(model).items()}
    d = {n: now[n] - prev[n] for n in now}  # float32, as telemetry computes it
    flat = np.concatenate([v.ravel() for v in d.values()])
    r = np.concatenate([prev[n].ravel() for n in d])
    w = np.concatenate([now[n].ravel() for n in d])
    pc = rec["param_change"]
    assert pc["l2"] == pytest.approx(np.sqrt(np.sum(flat.astype(np.float64) ** 2)), rel=1e-5)
    assert pc["l1"] == pytest.approx(np.sum(np.abs(flat.astype(np.float64))), rel=1e-6)
    assert pc["max_abs"] == pytest.approx(float(np.abs(flat).max()), rel=1e-6)
    assert pc["mean"] == pytest.approx(float(flat.astype(np.float64).mean()), rel=1e-5, abs=1e-12)
    assert pc["std"] == pytest.approx(float(flat.astype(np.float64).std()), rel=1e-4)
    assert pc["sign_flip_fraction"] == pytest.approx(float(np.mean(np.sign(w) * np.sign(r) < 0)), abs=1e-12)
    for t in thresholds:
        assert pc["sparsity"][telemetry.threshold_key(t)] == pytest.approx(float(np.mean(np.abs(flat) <= t)),
                                                                           abs=1e-12)
    assert pc["sparsity"]["1e-08"] >= 32 / flat.size  # the 4 frozen rows of 8
    for t in rel:
        assert pc["sparsity_rel"][telemetry.threshold_key(t)] == pytest.approx(
            float(np.mean(np.abs(flat) <= np.abs(r) * np.float32(t))), abs=1e-12)
    breakdowns = {"per_layer": lambda n: telemetry.layer_key(n), "per_component": telemetry.component_of}
    for key, row_of in breakdowns.items():
        rows = {}
        for n, v in d.items():
            if row_of(n) is not None:
                rows.setdefault(row_of(n), []).append(v.ravel())
        assert set(pc[key]) == set(rows)
        for row, parts in rows.items():
            v = np.concatenate(parts).astype(np.float64)
            assert pc[key][row]["l2"] == pytest.approx(np.sqrt(np.sum(v ** 2)), rel=1e-5)
            assert pc[key][row]["mean_abs"] == pytest.approx(np.mean(np.abs(v)), rel=1e-5)
            assert pc[key][row]["sparsity"]["1e-08"] == pytest.approx(np.mean(np.abs(v) <= 1e-8), abs=1e-12)
    assert set(pc["per_layer"]) == {"in_proj", "head"} | {f"layers.{i}" for i in range(blocks)}
    assert set(pc["per_component"]) == {"q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"}


# ---- sparse-update quality -------------------------------------------------------------------------


def reference_agreement(full, other, valid=None):
    """The sparse-quality metrics computed directly with torch.nn.functional, for comparison."""
    full, other = full.double().reshape(-1, full.shape[-1]), other.double().reshape(-1, other.shape[-1])
    if valid is not None:
        keep = valid.reshape(-1)
        full, other = full[keep], other[keep]
    kl = F.kl_div(other.log_softmax(-1), full.log_softmax(-1), log_target=True, reduction="batchmean")
    return {"kl": float(kl), "cosine": float(F.cosine_similarity(full, other, dim=-1).mean()),
            "mse": float((full - other).square().mean()),
            "top1_agree": float((full.argmax(-1) == other.argmax(-1)).double().mean())}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_quality_zero_threshold_is_exact_and_weights_restore_bit_exactly(tmp_path, dtype):
    torch.manual_seed(0)
    model = Blocks(dropout=0.3).to(dtype)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(5)
    xh, yh = torch.randn(24, 8, generator=gen).to(dtype), torch.randint(0, 3, (24,), generator=gen)
    tel = TrainingTelemetry(config(tmp_path, track_sparse_quality=True, sparse_quality_thresholds=[0.0, 1e9],
                                   track_holdout_logits=False))
    tel.set_holdout_data([(xh[:10], yh[:10]), (xh[10:], yh[10:])])

    def train_step(seed):
        model.train()
        backward(model, seed)
        opt.step()

    train_step(0)
    first = tel.on_batch_end(model, opt, 0, 0)
    assert "sparse_quality" not in first  # no previous weights yet
    opt.zero_grad()
    previous = snapshot(model)
    train_step(1)
    model.blocks[1].eval()  # mixed train/eval flags must come back as they were
    before = snapshot(model)
    flags = [m.training for m in model.modules()]
    rng = torch.get_rng_state()
    rec = tel.on_batch_end(model, opt, 1, 0)
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n  # bit-exact
    assert [m.training for m in model.modules()] == flags
    assert torch.equal(torch.get_rng_state(), rng)
    assert not os.path.exists(tmp_path / "last_checkpoint.safetensors.previous")

    sq = rec["sparse_quality"]
    zero = sq["0e+00"]
    assert zero["kl"] == 0.0 and zero["top1_agree"] == 1.0 and zero["mse"] == 0.0
    assert zero["cosine"] == pytest.approx(1.0, abs=1e-6)
    changed = sum(int((before[n].float() != previous[n].float()).sum()) for n in before)
    assert zero["kept_ratio"] == pytest.approx(changed / sum(t.numel() for t in before.values()))
    # Above every |dW|, nothing is kept: the "sparse" model is the previous one, which the test rebuilds.
    nothing = sq["1e+09"]
    assert nothing["kept_ratio"] == 0.0
    old, new = copy.deepcopy(model).eval(), copy.deepcopy(model).eval()
    old.load_state_dict(previous)
    with torch.no_grad():
        want = reference_agreement(new(xh), old(xh))
    loose = 1e-4 if dtype == torch.float32 else 2e-2
    for key, value in want.items():
        assert nothing[key] == pytest.approx(value, rel=loose, abs=1e-7), key
        assert nothing["random"][key] == pytest.approx(nothing[key], rel=1e-6, abs=1e-9)  # keep 0 = same mask
    assert want["kl"] > 0


def test_sparse_quality_random_baseline_keeps_the_same_share_and_leaves_global_rng(tmp_path):
    torch.manual_seed(0)
    model = Blocks()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    tel = TrainingTelemetry(config(tmp_path, track_sparse_quality=True, sparse_quality_thresholds=[1e-3]))
    gen = torch.Generator().manual_seed(1)
    tel.set_holdout_data((torch.randn(16, 8, generator=gen), torch.randint(0, 3, (16,), generator=gen)))
    for step in range(2):
        backward(model, step)
        opt.step()
        torch.manual_seed(123)
        rec = tel.on_batch_end(model, opt, step, 0)
        after = torch.rand(3)
        torch.manual_seed(123)
        assert torch.equal(after, torch.rand(3))  # the hook consumed nothing from the global generator
        opt.zero_grad()
    entry = rec["sparse_quality"]["1e-03"]
    assert 0.05 < entry["kept_ratio"] < 0.95
    assert set(entry["random"]) == {"kl", "cosine", "mse", "top1_agree"}
    assert entry["kl"] >= 0 and entry["random"]["kl"] >= 0


def test_sparse_quality_on_a_causal_lm_counts_supervised_positions_only(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model = transformers.LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(3))
    labels = ids.clone()
    labels[:, :5] = -100  # a masked prompt
    holdout = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    tel = TrainingTelemetry(config(tmp_path, track_sparse_quality=True, sparse_quality_thresholds=[0.0, 1e9],
                                   track_param_change=True))
    tel.set_holdout_data(holdout)
    for step in range(2):
        if step == 1:
            previous = snapshot(model)
        model(**holdout).loss.backward()
        opt.step()
        rec = tel.on_batch_end(model, opt, step, 0, batch=holdout)
        opt.zero_grad()
    sq = rec["sparse_quality"]
    assert sq["0e+00"]["kl"] == 0.0 and sq["0e+00"]["top1_agree"] == 1.0
    old = copy.deepcopy(model).eval()
    old.load_state_dict(previous, strict=False)
    with torch.no_grad():
        full = model.eval()(input_ids=ids).logits
        prev = old(input_ids=ids).logits
    valid = torch.zeros_like(ids, dtype=torch.bool)
    valid[:, :-1] = labels[:, 1:] != -100
    want = reference_agreement(full, prev, valid)
    for key, value in want.items():
        assert sq["1e+09"][key] == pytest.approx(value, rel=1e-4, abs=1e-7), key
    assert {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"} <= set(
        rec["param_change"]["per_component"])
    assert {"model.layers.0", "model.layers.1"} <= set(rec["param_change"]["per_layer"])


# ---- alerts ----------------------------------------------------------------------------------------


class Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def planted_run(tmp_path, **overrides):
    torch.manual_seed(0)
    model = Pair()
    opt = torch.optim.SGD([{"params": model.a.parameters(), "lr": 0.01, "name": "a"},
                           {"params": model.b.parameters(), "lr": 0.01, "name": "b"}])
    tel = TrainingTelemetry(config(tmp_path, **overrides))

    def collect(step, loss=1.0, scale=1.0, zero=()):
        gen = torch.Generator().manual_seed(step)
        for name, p in model.named_parameters():
            p.grad = torch.randn(p.shape, generator=gen) * scale
            if name.split(".")[0] in zero:
                p.grad.zero_()
        opt.step()
        return tel.on_batch_end(model, opt, step, 0, loss=loss)

    return model, opt, tel, collect


def codes(rec):
    return [(a["code"], a.get("group")) for a in (rec or {}).get("alerts", [])]


def test_loss_spike_alerts_once_when_it_starts_and_logs(tmp_path, caplog):
    _, _, _, collect = planted_run(tmp_path)
    with caplog.at_level(logging.WARNING, logger="telemetry"):
        quiet = [collect(s, loss=1.0 + 0.05 * math.sin(s)) for s in range(20)]
        spike = collect(20, loss=10.0)
        still = collect(21, loss=12.0)
        calm = collect(22, loss=1.0)
        again = collect(23, loss=9.0)
    assert all("alerts" not in r for r in quiet)
    assert codes(spike) == [("loss_spike", None)] and spike["alerts"][0]["severity"] == "warning"
    assert "alerts" not in still and "alerts" not in calm  # written once while it lasts
    assert codes(again) == [("loss_spike", None)]
    logged = [r for r in caplog.records if r.name == "telemetry" and "loss_spike" in r.getMessage()]
    assert len(logged) == 2 and all(r.levelno == logging.WARNING for r in logged)


def test_batches_of_one_alert_on_a_loss_past_their_tail_not_on_a_wrong_example(tmp_path):
    """Losses as batches of one give them: about 0.01 for an example the model has right (exactly 0 for one
    it is sure of), 0.5-2 for one it has wrong. A wrong example's loss is no spike (on the linear scale, which
    the 0 used to force, it was dozens of robust SDs); a loss 10x the worst of the window is one."""
    _, _, _, collect = planted_run(tmp_path)
    rng = np.random.default_rng(0)
    losses = [float(rng.uniform(0.5, 2.0)) if rng.random() < 0.1 else float(rng.lognormal(math.log(0.01), 1.5))
              for _ in range(60)]
    losses[7] = 0.0
    first = [2.3] * 10   # the run's scale: an untrained model's loss on 10 classes
    quiet = [collect(s, loss=v) for s, v in enumerate(first + losses)]
    assert sum(v > 0.5 for v in losses) >= 4 and all("alerts" not in r for r in quiet), \
        [r["alerts"] for r in quiet if "alerts" in r]
    worst = max(losses[-50:])
    spike = collect(70, loss=20 * worst)
    assert codes(spike) == [("loss_spike", None)] and "x the worst of the window" in spike["alerts"][0]["message"]


def test_gradient_spike_and_explosion(tmp_path):
    _, _, _, collect = planted_run(tmp_path)
    quiet = [collect(s) for s in range(20)]
    assert all("alerts" not in r for r in quiet)
    spike = collect(20, scale=3.0)
    assert codes(spike) == [("grad_spike", None)]
    assert all("alerts" not in collect(s) for s in range(21, 25))
    boom = collect(25, scale=100.0)
    assert codes(boom) == [("grad_explosion", None)] and boom["alerts"][0]["severity"] == "critical"


def test_gradients_that_grow_as_the_loss_falls_through_its_band_are_no_explosion(tmp_path):
    """A classifier leaving a plateau: the loss sits at 1.386 with gradient norms near 1 for 20 collections,
    then falls (0.9 at the next) while the gradients grow 12x, as a transformer's do when it starts to learn.
    That raised a critical grad_explosion; it is the learning, and no alert is raised. The same growth with
    the loss where it was is still one."""
    _, _, _, collect = planted_run(tmp_path)
    assert all("alerts" not in collect(s, loss=1.386 + 0.002 * math.sin(s)) for s in range(20))
    assert "alerts" not in collect(20, scale=12.0, loss=0.9)
    _, _, _, collect = planted_run(tmp_path / "flat")
    assert all("alerts" not in collect(s, loss=1.386 + 0.002 * math.sin(s)) for s in range(20))
    assert codes(collect(20, scale=12.0, loss=1.38)) == [("grad_explosion", None)]


def test_a_rise_of_a_few_percent_over_a_tight_history_is_no_spike(tmp_path):
    """A loss of exactly 1.0 for 20 collections has a MAD of 0: 1.3x and 1.9x are still no spike, however
    many robust SDs they make (a noisy run's short window can hold too little of its spread), 2.5x is."""
    _, _, _, collect = planted_run(tmp_path)
    assert all("alerts" not in collect(s) for s in range(20))
    assert "alerts" not in collect(20, scale=1.3, loss=1.3)
    assert "alerts" not in collect(21, scale=1.9, loss=1.9)
    both = collect(22, scale=3.0, loss=2.5)
    assert codes(both) == [("loss_spike", None), ("grad_spike", None)], codes(both)


def test_nan_loss_alerts_nonfinite(tmp_path):
    _, _, _, collect = planted_run(tmp_path)
    for s in range(3):
        collect(s)
    rec = collect(3, loss=float("nan"))
    assert codes(rec) == [("nonfinite", None)] and "loss" in rec["alerts"][0]["message"]
    assert rec["loss"] is None and "loss" in rec["nonfinite"]


def test_lr_zero_while_others_train(tmp_path):
    _, opt, _, collect = planted_run(tmp_path)
    assert "alerts" not in collect(0)
    opt.param_groups[1]["lr"] = 0.0
    rec = collect(1)
    assert ("lr_zero", "b") in codes(rec)
    for group in opt.param_groups:  # every group at 0 (e.g. the end of a schedule) is not this alert
        group["lr"] = 0.0
    assert "lr_zero" not in [c for c, _ in codes(collect(2))]


def test_frozen_group_needs_two_collections_beyond_the_first(tmp_path):
    _, _, _, collect = planted_run(tmp_path)
    assert "alerts" not in collect(0, zero=("b",))  # first collection never counts
    assert "alerts" not in collect(1, zero=("b",))  # streak 1
    rec = collect(2, zero=("b",))
    assert ("frozen_group", "b") in codes(rec)
    assert "alerts" not in collect(3, zero=("b",))  # once


def test_lora_style_zero_gradient_at_the_start_is_not_an_alert(tmp_path):
    _, _, _, collect = planted_run(tmp_path / "lora")
    recs = [collect(0, zero=("a",))] + [collect(s) for s in range(1, 6)]
    assert all("alerts" not in r for r in recs)


def test_on_alert_callback_sees_each_new_alert_and_can_stop_training(tmp_path):
    seen = []
    model, opt, tel, collect = planted_run(tmp_path, strict=False)
    tel.on_alert = seen.append
    for s in range(10):
        collect(s)
    collect(10, loss=float("inf"))
    assert [(a["code"], a["step"]) for a in seen] == [("nonfinite", 11)]

    class Stop(Exception):
        pass

    def stop(alert):
        raise Stop(alert["code"])

    tel2 = TrainingTelemetry(config(tmp_path / "two", strict=False), on_alert=stop)
    opt.step()
    tel2.on_batch_end(model, opt, 0, 0, loss=1.0)
    opt.step()
    with pytest.raises(Stop):  # the user's callback is not swallowed by the hook's error guard
        tel2.on_batch_end(model, opt, 1, 0, loss=float("nan"))


# ---- healthy runs raise no alerts ------------------------------------------------------------------


def test_no_alerts_on_the_healthy_example(tmp_path):
    import example_train
    path = tmp_path / "t.yaml"
    path.write_text("telemetry:\n  collect_every_n: 1\n  batch_label_key: winner\n  strict: true\n")
    example_train.train("healthy", out=str(tmp_path / "run"), config_path=str(path), quiet=True)
    recs = records(tmp_path / "run")
    assert len(recs) == 384  # every step of 3 epochs: the strictest test of false alarms
    assert [r["alerts"] for r in recs if "alerts" in r] == []
    assert all("errors" not in r for r in recs)
    assert 1e-4 < recs[-1]["update_ratio"]["backbone"] < 1e-1 and recs[-1]["drift"]["overall"] > 0


def test_healthy_example_with_the_comprehensive_preset(tmp_path):
    import example_train
    path = tmp_path / "t.yaml"
    path.write_text("telemetry:\n  preset: comprehensive\n  collect_every_n: 4\n  batch_label_key: winner\n"
                    "  strict: true\n")
    example_train.train("healthy", out=str(tmp_path / "run"), config_path=str(path), epochs=1, quiet=True)
    recs = records(tmp_path / "run")
    assert [r["alerts"] for r in recs if "alerts" in r] == [] and all("errors" not in r for r in recs)
    last = recs[-1]
    for key in ("layer_stats", "update_ratio", "drift", "weight_norm", "param_change", "sparse_quality", "system"):
        assert key in last, key
    assert last["system"]["step_time_s"] > 0 and 0 < last["system"]["telemetry_share"] < 1


def test_no_alerts_on_a_healthy_cnn_with_sgd_momentum(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    tel = TrainingTelemetry(config(tmp_path, track_layer_stats=True))
    gen = torch.Generator().manual_seed(0)
    centers = torch.randn(4, 1, 8, 8, generator=gen)
    recs = []
    for step in range(300):
        y = torch.randint(0, 4, (16,), generator=gen)
        x = centers[y] + 0.8 * torch.randn(16, 1, 8, 8, generator=gen)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        recs.append(tel.on_batch_end(model, opt, step, 0, loss=loss))
        opt.zero_grad()
    recs = [r for r in recs if r is not None]
    assert len(recs) == 300 and recs[-1]["loss"] < recs[0]["loss"]
    assert [r["alerts"] for r in recs if "alerts" in r] == []


# ---- custom metrics and system metrics -------------------------------------------------------------


def test_add_metric_results_context_and_failure_isolation(tmp_path):
    model = Pair()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tel = TrainingTelemetry(config(tmp_path, strict=False))
    contexts = []

    def good(m, o, context):
        contexts.append(context)
        return {"w00": m.a.weight[0, 0], "groups": len(o.param_groups)}

    tel.add_metric("good", good)
    tel.add_metric("bad", lambda m, o, c: 1 / 0)
    tel.add_metric("notdict", lambda m, o, c: 5.0)
    batch = {"x": torch.randn(4, 6)}
    with pytest.warns(RuntimeWarning) as caught:
        recs = []
        for step in range(2):
            model(batch["x"]).sum().backward()
            opt.step()
            recs.append(tel.on_batch_end(model, opt, step, 3, batch=batch, loss=torch.tensor(0.5)))
            opt.zero_grad()
    rec = recs[-1]
    assert rec["custom"] == {"good": {"w00": pytest.approx(model.a.weight[0, 0].item()), "groups": 1}}
    assert rec["errors"]["custom.bad"].startswith("ZeroDivisionError")
    assert rec["errors"]["custom.notdict"].startswith("TypeError")
    assert rec["gradient_norm"]["overall"] > 0 and "update_ratio" in rec  # built-ins unaffected
    assert sum("custom.bad" in str(w.message) for w in caught) == 1  # warned once
    assert contexts[-1]["step"] == 2 and contexts[-1]["batch_idx"] == 1 and contexts[-1]["epoch"] == 3
    assert contexts[-1]["batch"] is batch and float(contexts[-1]["loss"]) == 0.5
    strict = TrainingTelemetry(config(tmp_path / "strict"))
    strict.add_metric("bad", lambda m, o, c: 1 / 0)
    opt.step()
    with pytest.raises(ZeroDivisionError):
        strict.on_batch_end(model, opt, 0, 0)
    with pytest.raises(ValueError):
        tel.add_metric("a.b", good)


def vm_rss_mb():
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def test_system_metrics_throughput_tokens_and_memory(tmp_path):
    import time
    model = Pair()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tel = TrainingTelemetry(config(tmp_path, collect_every_n=2))
    mask = torch.ones(4, 10, dtype=torch.long)
    mask[0, 7:] = 0
    batch = {"input_ids": torch.randint(0, 50, (4, 10)), "attention_mask": mask}
    recs = []
    for step in range(5):
        time.sleep(0.02)
        model(torch.randn(3, 6)).sum().backward()
        opt.step()
        recs.append(tel.on_batch_end(model, opt, step, 0, batch=batch))
        opt.zero_grad()
    first, _, second, _, third = recs
    assert "step_time_s" not in first["system"]
    for rec in (second, third):
        system = rec["system"]
        assert system["step_time_s"] >= 0.02
        assert system["examples_per_s"] * system["step_time_s"] == pytest.approx(4)
        assert system["tokens_per_s"] * system["step_time_s"] == pytest.approx(37)
        assert 0 < system["telemetry_share"] < 1
        assert not any(k.startswith(("cuda", "gpu")) for k in system)  # no CUDA here: keys absent
    if os.path.exists("/proc/self/status"):
        assert third["system"]["rss_mb"] == pytest.approx(vm_rss_mb(), rel=0.2)


def test_throughput_counts_every_micro_batch_of_a_step(tmp_path):
    """Gradient accumulation over 3 micro-batches of 4, the hook called after each (it collects only after the
    step): an optimizer step took 12 examples, and examples_per_s said 4 a step."""
    import time

    torch.manual_seed(0)
    model = nn.Linear(6, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tel = TrainingTelemetry(config(tmp_path, collect_every_n=1))
    batch = (torch.randn(4, 6), torch.randn(4, 1))
    recs = []
    for step in range(4):
        for micro in range(3):
            time.sleep(0.01)
            F.mse_loss(model(batch[0]), batch[1]).backward()
            if micro == 2:
                opt.step()
            rec = tel.on_batch_end(model, opt, 3 * step + micro, 0, batch=batch)
        recs.append(rec)
        opt.zero_grad()
    for rec in recs[1:]:
        assert rec["system"]["examples_per_s"] * rec["system"]["step_time_s"] == pytest.approx(12)


# ---- pure functions --------------------------------------------------------------------------------


def test_layer_key_threshold_key_and_robust_z():
    assert telemetry.layer_key("model.layers.12.mlp.up_proj.weight") == "model.layers.12"
    assert telemetry.layer_key("backbone.0.weight") == "backbone.0"
    assert telemetry.layer_key("head.weight") == "head"
    assert telemetry.component_of("model.layers.1.self_attn.q_proj.lora_A.default.weight") == "q_proj"
    assert telemetry.component_of("head.weight") is None
    assert [telemetry.threshold_key(t) for t in (1e-8, 1e-3, 2.5e-4)] == ["1e-08", "1e-03", "0.00025"]
    history = [1.0, 1.1, 0.9, 1.05, 0.95, 1.0, 1.02, 0.98]
    logs = np.log(history)
    mad = np.median(np.abs(logs - np.median(logs)))
    assert telemetry.robust_z(history, 2.0) == pytest.approx((np.log(2.0) - np.median(logs)) / (1.4826 * mad))
    assert telemetry.robust_z(history, 1.0) < 1
    # batches of one: right examples score about 0.01 (one exactly 0 in float32), a wrong one 1.5, which is the
    # usual tail on the log scale where the linear scale would call it a spike of dozens of SDs
    ones = [0.012, 0.0, 0.03, 0.004, 0.9, 0.02, 0.0008, 0.05, 0.01, 1.2, 0.002, 0.015, 0.3, 0.006, 0.04]
    logs = np.log(np.maximum(ones, 0.0008))
    mad = np.median(np.abs(logs - np.median(logs)))
    assert telemetry.robust_z(ones, 1.5) == pytest.approx((np.log(1.5) - np.median(logs)) / (1.4826 * mad))
    assert telemetry.robust_z(ones, 1.5) < 8 and telemetry.robust_z([0.0] * 5, 1.0) > 8   # the latter linear
