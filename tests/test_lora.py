"""LoRA telemetry on real peft and transformers. The references are peft's own get_delta_weight, a merged
copy of the model, dense SVDs, HF's own causal-LM loss and the HF Trainer's own logged grad_norm and loss."""

import copy
import gc
import json
import math
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
from peft import LoraConfig, get_peft_model  # noqa: E402
from transformers import (LlamaConfig, LlamaForCausalLM, PrinterCallback, Trainer, TrainerCallback,  # noqa: E402
                          TrainingArguments)

import telemetry  # noqa: E402
from telemetry import TelemetryConfig, TrainingTelemetry  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 128


def tiny_llama(seed=0):
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=4, vocab_size=VOCAB))


def lora_model(seed=0, **lora):
    spec = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"])
    return get_peft_model(tiny_llama(seed), LoraConfig(**{**spec, **lora}))


def lora_layers(model):
    """peft's LoRA layers, found through peft's API (not telemetry's duck typing)."""
    from peft.tuners.lora import LoraLayer
    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoraLayer)]


def randomize_adapters(model, seed, scale=0.3):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_A." in name or ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype) * scale)


def dense_deltas(model):
    return {n: m.get_delta_weight("default").detach().double() for n, m in lora_layers(model)}


def layer_of(name):
    return int(name.split(".layers.")[1].split(".")[0])


def rel(a, b):
    return abs(a - b) / abs(b)


def new_telemetry(tmp_path, **kw):
    return TrainingTelemetry(TelemetryConfig(output_dir=str(tmp_path), collect_every_n=1, strict=True, **kw))


def read_records(run_dir):
    with open(os.path.join(run_dir, "telemetry.jsonl")) as f:
        return [json.loads(line) for line in f]


# ---- Gram-based norms against peft's dense delta weights ----------------------------------------------


@pytest.mark.parametrize("use_dora", [False, True])
@pytest.mark.parametrize("use_rslora", [False, True])
def test_adapter_norm_and_stable_rank_match_peft_dense(tmp_path, use_rslora, use_dora):
    # rank_pattern/alpha_pattern give modules different r and scaling: a wrong or cached s would show.
    model = lora_model(use_rslora=use_rslora, use_dora=use_dora, rank_pattern={"v_proj": 2},
                       alpha_pattern={"down_proj": 32})
    randomize_adapters(model, 1)
    layers = lora_layers(model)
    assert len({m.scaling["default"] for _, m in layers}) == 3
    rec = new_telemetry(tmp_path, track_gradients=False).on_batch_end(model, None, 1, 0)
    lora = rec["lora"]

    dense = dense_deltas(model)
    sq = {n: float(d.square().sum()) for n, d in dense.items()}
    assert lora["modules"] == len(dense) == 6
    assert rel(lora["adapter_norm"]["overall"], math.sqrt(sum(sq.values()))) < 1e-5
    for i in (0, 1):
        ref = math.sqrt(sum(v for n, v in sq.items() if layer_of(n) == i))
        assert rel(lora["adapter_norm"][f"layer_{i}"], ref) < 1e-5
    for name, module in layers:  # module by module, through the pure function
        a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
        assert rel(float(telemetry.lora_norm_sq(a, b, module.scaling["default"])), sq[name]) < 1e-5

    if not use_dora:  # a merged copy: merged weight - base weight is the adapter's dW
        merged = copy.deepcopy(model).merge_and_unload()
        merged_weights = dict(merged.named_parameters())
        for name, module in layers:
            diff = merged_weights[name.replace("base_model.model.", "", 1) + ".weight"].double() \
                - module.base_layer.weight.double()
            assert rel(math.sqrt(sq[name]), float(diff.norm())) < 1e-5
    else:  # DoRA: adapter_norm is the low-rank part s*B*A; its magnitude vector is reported apart
        assert lora["dora_magnitude_drift"] == 0.0

    ranks = []
    for d in dense.values():
        s = torch.linalg.svdvals(d)
        ranks.append(float(s.square().sum() / s[0] ** 2))
    assert rel(lora["stable_rank"]["min"], min(ranks)) < 1e-5
    assert rel(lora["stable_rank"]["median"], float(np.median(ranks))) < 1e-5
    assert rel(lora["stable_rank"]["max"], max(ranks)) < 1e-5
    assert lora["b_zero_fraction"] == 0.0


def test_stable_ranks_from_grams_match_the_dense_svd():
    # Four pairs of one shape: random, a fresh adapter (B = 0), rank one, and singular values from 1 to 1e-6.
    g = torch.Generator().manual_seed(0)
    a = torch.randn(4, 8, 300, generator=g)
    b = torch.randn(4, 500, 8, generator=g)
    b[1] = 0
    b[2] = torch.randn(500, 1, generator=g) * torch.randn(1, 8, generator=g)
    q = torch.linalg.qr(torch.randn(500, 8, generator=g, dtype=torch.float64))[0]
    b[3] = (q * torch.logspace(0, -6, 8, dtype=torch.float64)).float()
    ranks = telemetry.stable_ranks(*telemetry.lora_grams(a, b))
    for k in range(4):
        s = torch.linalg.svdvals(b[k].double() @ a[k].double())
        ref = float(s.square().sum() / s[0] ** 2) if s[0] > 0 else 0.0
        assert (float(ranks[k]) == ref == 0.0) if k == 1 else rel(float(ranks[k]), ref) < 1e-10
    b[0, 3, 2] = float("nan")  # a non-finite adapter has no rank; the others keep theirs
    again = telemetry.stable_ranks(*telemetry.lora_grams(a, b))
    assert math.isnan(float(again[0])) and torch.equal(again[1:], ranks[1:])


def test_a_nonfinite_adapter_leaves_the_other_layers_norms(tmp_path):
    model = lora_model()
    randomize_adapters(model, 1)
    layers = lora_layers(model)
    with torch.no_grad():
        next(m for n, m in layers if layer_of(n) == 0).lora_A["default"].weight[0, 0] = float("nan")
    dense = dense_deltas(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the nonfinite alert
        rec = new_telemetry(tmp_path, track_gradients=False).on_batch_end(model, None, 1, 0)
    norms = rec["lora"]["adapter_norm"]
    assert norms["layer_0"] is None and norms["overall"] is None  # NaN, recorded as null
    ref = math.sqrt(sum(float(d.square().sum()) for n, d in dense.items() if layer_of(n) == 1))
    assert rel(norms["layer_1"], ref) < 1e-5


def test_an_inactive_adapter_is_left_out_of_the_lora_section(tmp_path):
    """A trained adapter "old" kept beside a new one that is being trained: only the active "new" is measured.
    Its B is still zero, so b_zero_fraction is 1 and adapter_norm 0, as get_delta_weight("new") says."""
    model = lora_model()
    randomize_adapters(model, 1)
    model.add_adapter("new", LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    model.set_adapter("new")
    layers = lora_layers(model)
    assert all(float(m.get_delta_weight("new").norm()) == 0.0 for _, m in layers)
    assert all(float(m.get_delta_weight("default").norm()) > 0.0 for _, m in layers)
    lora = new_telemetry(tmp_path, track_gradients=False).on_batch_end(model, None, 1, 0)["lora"]
    assert lora["modules"] == len(layers) == 6
    assert lora["b_zero_fraction"] == 1.0 and lora["adapter_norm"]["overall"] == 0.0


@pytest.mark.parametrize("keep_reference,whole", [(True, True), (False, True), (True, False)])
def test_adapter_delta_matches_dense_difference(tmp_path, monkeypatch, keep_reference, whole):
    # Without weight_delta's reference pass, the lora section keeps a reference of the adapters itself.
    # whole=False: the reference counts as large, mapped afresh and handed back tensor by tensor; else the
    # map is kept from one collection to the next while the file is rewritten in place under it.
    if not whole:
        monkeypatch.setattr(telemetry, "WHOLE_PASS_BYTES", 0)
    model = lora_model(modules_to_save=["lm_head"])
    randomize_adapters(model, 1)
    tele = new_telemetry(tmp_path, track_weight_delta=keep_reference, track_update_ratio=keep_reference,
                         track_gradients=False)
    first = tele.on_batch_end(model, None, 1, 0)["lora"]["adapter_delta"]
    kept, _ = telemetry.read_tensor_header(os.path.join(str(tmp_path), "last_checkpoint.safetensors"))
    assert all(".lora_" in name for name in kept) != keep_reference  # adapters only, or every weight
    assert first == {"overall": None, "layer_0": None, "layer_1": None}  # no reference yet: null, never 0
    g = torch.Generator().manual_seed(5)
    for step in (2, 3, 4):  # the reference is rewritten at each: every delta is against the one before
        before = dense_deltas(model)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.add_(torch.randn(p.shape, generator=g) * 0.05 * step)
        delta = tele.on_batch_end(model, None, step, 0)["lora"]["adapter_delta"]
        after = dense_deltas(model)
        sq = {n: float((after[n] - before[n]).square().sum()) for n in after}
        assert rel(delta["overall"], math.sqrt(sum(sq.values()))) < 1e-5
        for i in (0, 1):
            assert rel(delta[f"layer_{i}"], math.sqrt(sum(v for n, v in sq.items() if layer_of(n) == i))) < 1e-5


def test_adapter_delta_keeps_precision_for_a_tiny_step(tmp_path):
    # A step 1e-7 the size of the adapter: expanding ||X1||^2 + ||X0||^2 - 2<X1, X0> would cancel away
    # most digits even in float64. peft in float64 gives an exact dense reference.
    model = lora_model().double()
    randomize_adapters(model, 1)
    tele = new_telemetry(tmp_path, track_gradients=False)
    tele.on_batch_end(model, None, 1, 0)
    before = dense_deltas(model)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 3e-8)
    rec = tele.on_batch_end(model, None, 2, 0)
    after = dense_deltas(model)
    ref = math.sqrt(sum(float((after[n] - before[n]).square().sum()) for n in after))
    assert ref < 1e-6 * rec["lora"]["adapter_norm"]["overall"]
    assert rel(rec["lora"]["adapter_delta"]["overall"], ref) < 1e-6


def test_dora_magnitude_drift_against_kept_copies(tmp_path):
    model = lora_model(use_dora=True)
    randomize_adapters(model, 2)
    mags = {n: p for n, p in model.named_parameters() if "lora_magnitude_vector" in n}
    assert len(mags) == 6
    start = {n: p.detach().clone() for n, p in mags.items()}
    tele = new_telemetry(tmp_path, track_gradients=False)
    assert tele.on_batch_end(model, None, 1, 0)["lora"]["dora_magnitude_drift"] == 0.0
    with torch.no_grad():
        for p in mags.values():
            p.mul_(1.05).add_(0.01)
    rec = tele.on_batch_end(model, None, 2, 0)
    ref = math.sqrt(sum(float((mags[n] - start[n]).double().square().sum()) for n in mags)
                    / sum(float(start[n].double().square().sum()) for n in mags))
    assert rel(rec["lora"]["dora_magnitude_drift"], ref) < 1e-5
    assert rec["weight_delta"].keys() >= {"lora_A", "lora_B", "lora_magnitude"}


# ---- training steps -------------------------------------------------------------------------------------


def lm_batch(seed, n=4, t=12):
    ids = torch.randint(0, VOCAB, (n, t), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone()}


def test_first_step_has_zero_A_gradient_without_an_alarm(tmp_path):
    model = lora_model()  # peft's own init: B = 0, so dLoss/dA = 0 at the first step
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    tele = new_telemetry(tmp_path)
    for step in (1, 2):
        batch = lm_batch(step)
        loss = model(**batch).loss
        loss.backward()
        a_grads = [p.grad for n, p in model.named_parameters() if ".lora_A." in n]
        b_grads = [p.grad for n, p in model.named_parameters() if ".lora_B." in n]
        ref_a = float(torch.nn.utils.get_total_norm(a_grads))
        ref_b = float(torch.nn.utils.get_total_norm(b_grads))
        optimizer.step()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            rec = tele.on_batch_end(model, optimizer, step, 0, batch=batch, loss=loss)
        optimizer.zero_grad()
        lora = rec["lora"]
        if step == 1:
            assert ref_a == 0.0 and lora["grad_norm_A"] == 0.0 and rec["gradient_norm"]["lora_A"] == 0.0
            assert [str(w.message) for w in caught] == []  # a zero A gradient at step 1 is expected
            assert not rec.get("alerts")
        else:
            assert ref_a > 0 and rel(lora["grad_norm_A"], ref_a) < 1e-5
        assert ref_b > 0 and rel(lora["grad_norm_B"], ref_b) < 1e-5
        assert rel(rec["gradient_norm"]["lora_B"], ref_b) < 1e-5
        assert lora["b_zero_fraction"] == 0.0  # collected after the step: B has moved


def test_adapter_left_out_of_the_optimizer_shows_zero_B_and_zero_delta(tmp_path):
    model = lora_model(modules_to_save=["lm_head"])
    head = [p for n, p in model.named_parameters() if "modules_to_save" in n]
    optimizer = torch.optim.AdamW(head, lr=1e-2)  # the adapters were forgotten: trl #3926's symptom
    tele = new_telemetry(tmp_path)
    for step in (1, 2, 3):
        batch = lm_batch(step)
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        rec = tele.on_batch_end(model, optimizer, step, 0, batch=batch, loss=loss)
        optimizer.zero_grad()
    lora = rec["lora"]
    assert lora["b_zero_fraction"] == 1.0
    assert lora["adapter_norm"]["overall"] == 0.0 and lora["adapter_delta"]["overall"] == 0.0
    assert lora["grad_norm_B"] > 0  # gradients arrive; nothing applies them
    # The adapters are named as outside the optimizer, once, and kept out of the group norms.
    assert set(rec["weight_delta"]) == {"overall", "group_0"} and rec["weight_delta"]["group_0"] > 0
    outside = json.loads((tmp_path / "run.json").read_text())["not_in_optimizer"]["names"]
    assert outside == [n for n, p in model.named_parameters() if p.requires_grad and "lora_" in n]


def test_an_optimizer_at_lr_0_is_the_cause_of_an_adapter_that_stays_at_zero(tmp_path):
    """peft LoRA trained with AdamW at lr 0: B stays at its zero start, and with it A's gradient. The analyzer
    led with lora_not_learning and, under it, "group 'lora_A' does not train while the other groups do",
    which no group did; lr_zero came second. A learning rate of 0 for every group is the cause: lr_zero
    leads, with the adapter that stays at zero under it."""
    import analyze_telemetry as at

    model = lora_model()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.0)
    tele = TrainingTelemetry(TelemetryConfig(output_dir=str(tmp_path), collect_every_n=2))
    for step in range(1, 41):
        batch = lm_batch(step)
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        tele.on_batch_end(model, optimizer, step, 0, batch=batch, loss=loss)
        optimizer.zero_grad()
    tele.close()
    assert all(float(p.abs().max()) == 0 for n, p in model.named_parameters() if ".lora_B." in n)
    found = at.diagnose(at.load_run(tmp_path, progress=False))
    assert found[0].code == "lr_zero" and "every group" in found[0].message, [(f.code, f.message) for f in found]
    assert "lora_not_learning" in {c.code for c in at.every_finding(found[0].consequences)}
    assert "frozen_group" not in {f.code for f in at.every_finding(found)}  # no group trains, none "while others do"


def test_lora_groups_partition_beside_optimizer_groups(tmp_path):
    model = lora_model(modules_to_save=["lm_head"])
    named = dict((n, p) for n, p in model.named_parameters() if p.requires_grad)
    a = [p for n, p in named.items() if ".lora_A." in n]
    rest = [p for n, p in named.items() if ".lora_A." not in n]
    head = [p for n, p in named.items() if "modules_to_save" in n]
    # An optimizer group named like a LoRA group: same members are not repeated, other members are renamed.
    optimizer = torch.optim.SGD([{"params": a, "lr": 0.1, "name": "lora_A"},
                                 {"params": rest, "lr": 0.4, "name": "other"}])
    tele = new_telemetry(tmp_path)
    for step in (1, 2):
        batch = lm_batch(step)
        model(**batch).loss.backward()
        grads = {n: p.grad.clone() for n, p in named.items()}
        optimizer.step()
        rec = tele.on_batch_end(model, optimizer, step, 0)
        optimizer.zero_grad()
    norms = rec["gradient_norm"]
    assert list(norms) == ["overall", "lora_A", "other", "lora_B", "other_lora"]

    def ref(pick):
        return float(torch.nn.utils.get_total_norm([g for n, g in grads.items() if pick(n)]))

    assert rel(norms["lora_B"], ref(lambda n: ".lora_B." in n)) < 1e-5
    assert rel(norms["other_lora"], ref(lambda n: "modules_to_save" in n)) < 1e-5
    assert rel(norms["other"], ref(lambda n: ".lora_A." not in n)) < 1e-5
    for section in ("gradient_norm", "weight_delta"):  # the LoRA partition's squares add up to overall
        s = rec[section]
        assert rel(s["lora_A"] ** 2 + s["lora_B"] ** 2 + s["other_lora"] ** 2, s["overall"] ** 2) < 1e-5
    assert rec["learning_rates"] == {"overall": 0.4, "lora_A": 0.1, "other": 0.4, "lora_B": 0.4,
                                     "other_lora": 0.4}
    info = json.load(open(os.path.join(str(tmp_path), "run.json")))
    assert info["groups"]["other_lora"]["names"] == [n for n in named if "modules_to_save" in n]
    assert len(head) == 1


def test_lora_section_absent_without_lora_and_off_with_track_lora_false(tmp_path):
    plain = tiny_llama()
    assert "lora" not in new_telemetry(tmp_path / "plain", track_gradients=False).on_batch_end(plain, None, 1, 0)
    rec = new_telemetry(tmp_path / "off", track_lora=False, track_gradients=False).on_batch_end(
        lora_model(), None, 1, 0)
    assert "lora" not in rec and list(rec["weight_delta"]) == ["overall", "all"]


# ---- language-model holdout and batch stats ---------------------------------------------------------------


def test_lm_holdout_matches_hf_loss_and_passes_no_labels(tmp_path):
    model = lora_model()
    randomize_adapters(model, 3, scale=0.1)
    g = torch.Generator().manual_seed(7)
    lengths = [5, 9, 12, 7, 10, 6]
    examples = []
    for t in lengths:
        ids = torch.randint(0, VOCAB, (t,), generator=g)
        labels = ids.clone()
        labels[:2] = -100  # a masked prompt
        examples.append((ids, labels))

    def pad(group):
        width = max(len(ids) for ids, _ in group)
        out = {"input_ids": torch.zeros(len(group), width, dtype=torch.long),
               "attention_mask": torch.zeros(len(group), width, dtype=torch.long),
               "labels": torch.full((len(group), width), -100)}
        for i, (ids, labels) in enumerate(group):
            out["input_ids"][i, :len(ids)] = ids
            out["attention_mask"][i, :len(ids)] = 1
            out["labels"][i, :len(ids)] = labels
        return out

    token_ids = [3, 17, 99]
    tele = new_telemetry(tmp_path, holdout_token_ids=token_ids, track_gradients=False)
    tele.set_holdout_data([pad(examples[:3]), pad(examples[3:])])  # two batches of different widths
    seen = []
    hook = model.register_forward_pre_hook(lambda m, args, kwargs: seen.append(set(kwargs)), with_kwargs=True)
    model.train()
    try:
        hold = tele.on_batch_end(model, None, 1, 0)["holdout_logits"]
    finally:
        hook.remove()
    # the two batches, the first once more with its last token changed: a causal LM's earlier predictions
    # stay as they were (future_probe), and the first again as it was and reversed (order_probe), at the first
    # evaluation only; and the first batch's most padded row alone (padding_probe), which padding after the text
    # leaves as it scores in its batch
    assert len(seen) == 6 and all("labels" not in keys for keys in seen) and hold["sees_future"] is False
    assert hold["padding_positions"] == 7 and hold["padding_nll"][0] == pytest.approx(hold["padding_nll"][1], rel=1e-5)
    assert hold["eval_probe"]["repeat"] == 0 and hold["eval_probe"]["reorder"] < 1e-5
    assert model.training  # the holdout put train mode back

    model.eval()
    with torch.no_grad():
        for i, (ids, labels) in enumerate(examples):
            out = model(input_ids=ids[None], labels=labels[None])  # HF's own shifted causal-LM loss
            assert rel(hold["nll"][i], float(out.loss)) < 1e-5
            logits, target = out.logits[0, :-1], labels[1:]
            valid = target != -100
            acc = float((logits.argmax(-1) == target)[valid].float().mean())
            assert hold["token_accuracy"][i] == pytest.approx(acc, abs=1e-6)
            first = int(valid.nonzero()[0])
            assert hold["token_logits"][i] == pytest.approx(logits[first, token_ids].tolist(), rel=1e-5)
        everything = model(**pad(examples))  # one padded batch: HF's mean over every supervised token
    assert rel(hold["loss"], float(everything.loss)) < 1e-5
    assert hold["tokens"] == [t - 2 for t in lengths] and hold["token_ids"] == token_ids


def test_an_additive_attention_mask_is_read_as_no_padding():
    """token_balance reads attention_mask as HF's 0/1 padding mask; an additive one (0 where attended, -1e9 at
    padding) marks no padding: the batch's padding share and the padding it supervises read 0, where reading its
    0s as padding would call the text padding (and padding_supervised would fire on every run)."""
    ids = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]])
    labels = torch.where(mask.bool(), ids, torch.full_like(ids, -100))
    stats = telemetry.token_balance({"input_ids": ids, "attention_mask": mask, "labels": labels})
    assert float(stats["padding_share"]) == 0.25 and float(stats["padding_supervised"]) == 0.0
    additive = {"input_ids": ids, "attention_mask": (1.0 - mask) * -1e9, "labels": labels}
    stats = telemetry.token_balance(additive)
    assert float(stats["padding_share"]) == 0.0 and float(stats["padding_supervised"]) == 0.0


def test_label_share_flags_an_all_masked_batch(tmp_path):
    model = lora_model()
    ids = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]])
    tele = new_telemetry(tmp_path, track_gradients=False)
    masked = {"input_ids": ids, "attention_mask": mask, "labels": torch.full((2, 6), -100)}
    stats = tele.on_batch_end(model, None, 1, 0, batch=masked)["batch_stats"]
    assert stats["label_share"] == 0.0 and stats["tokens"] == 12 and stats["padding_share"] == 0.25
    half = dict(masked, labels=torch.where(mask.bool(), ids, torch.full_like(ids, -100)))
    stats = tele.on_batch_end(model, None, 2, 0, batch=half)["batch_stats"]
    assert stats["label_share"] == pytest.approx(float(np.mean(half["labels"].numpy() != -100)))


# ---- HF Trainer: the callback against the Trainer's own logs --------------------------------------------


class TokenDataset(torch.utils.data.Dataset):
    """16 tokens an example: 2 prompt tokens masked in the labels, 2 padding tokens at the end."""

    def __init__(self, n=64, seed=1):
        self.ids = torch.randint(0, VOCAB, (n, 16), generator=torch.Generator().manual_seed(seed))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        mask = torch.ones(16, dtype=torch.long)
        mask[-2:] = 0
        labels = self.ids[i].masked_fill(mask == 0, -100)
        labels[:2] = -100
        return {"input_ids": self.ids[i], "attention_mask": mask, "labels": labels}


def run_trainer(tmp_path, model, tele, steps, accumulation=1, logging_steps=1, optimizer=None):
    args = TrainingArguments(output_dir=str(tmp_path / "hf"), per_device_train_batch_size=4, max_steps=steps,
                             gradient_accumulation_steps=accumulation, logging_steps=logging_steps,
                             max_grad_norm=1e9, learning_rate=1e-2, report_to=[], use_cpu=True,
                             save_strategy="no", disable_tqdm=True, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=TokenDataset(), callbacks=[tele.hf_callback()],
                      optimizers=(optimizer, None))
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    return trainer, {h["step"]: h for h in trainer.state.log_history if "grad_norm" in h}


def test_trainer_grad_norm_loss_and_all_lrs_match_the_trainers_log(tmp_path):
    model = lora_model()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    # LoRA+: two groups at different lrs; the Trainer itself logs group 0's only.
    optimizer = torch.optim.AdamW([{"params": [p for n, p in named if "lora_A" in n], "name": "A"},
                                   {"params": [p for n, p in named if "lora_B" in n], "name": "B",
                                    "lr": 4e-2}], lr=1e-2)
    hooks = (len(model._forward_pre_hooks), len(model._forward_hooks))
    tele = new_telemetry(tmp_path / "run")
    tele.set_holdout_data(lm_batch(99, n=3, t=10))
    _, logged = run_trainer(tmp_path, model, tele, steps=5, optimizer=optimizer)
    records = read_records(str(tmp_path / "run"))

    assert [r["step"] for r in records] == [1, 2, 3, 4, 5] == sorted(logged)
    errors = []
    for r in records:
        log = logged[r["step"]]
        assert r["trainer"]["grad_norm"] == log["grad_norm"] and r["trainer"]["loss"] == log["loss"]
        errors.append(rel(r["gradient_norm"]["overall"], log["grad_norm"]))
        assert rel(r["loss"], log["loss"]) < 1e-5
        assert rel(r["learning_rates"]["A"], log["learning_rate"]) < 1e-9
        assert rel(r["learning_rates"]["B"], 4 * log["learning_rate"]) < 1e-9
        # the training micro-batch, seen by the forward hook (not the 3 x 10 holdout batch)
        stats = dict(r["batch_stats"])
        assert len(stats.pop("fingerprint")) == 2
        assert stats == {"batch_size": 4, "tokens": 64, "label_share": 0.75, "padding_share": 0.125,
                         "padding_supervised": 0.0}
        assert r["holdout_logits"]["kind"] == "lm"
    assert max(errors) < 1e-5
    first = records[0]["lora"]  # step 1: B = 0, so the whole gradient is B's
    assert first["grad_norm_A"] == 0.0 and rel(first["grad_norm_B"], logged[1]["grad_norm"]) < 1e-5
    assert records[-1]["lora"]["adapter_delta"]["overall"] > 0
    assert (len(model._forward_pre_hooks), len(model._forward_hooks)) == hooks  # removed at train end


def test_a_model_fine_tuned_in_bf16_at_a_small_lr_is_told_its_updates_round_away(tmp_path):
    """The Llama cast to bfloat16 as a whole and fine-tuned by the Trainer with torch's AdamW at 2e-5, stepping
    its bf16 weights itself: run.json names the optimizer inside accelerate's wrapper, and the analyzer names the
    weight size above which a step rounds away. The weights the test kept before training say the same: every
    element above that size is exactly where it started, and most of the ones under half of it moved."""
    import analyze_telemetry as at

    model = tiny_llama().to(torch.bfloat16)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    tele = new_telemetry(tmp_path / "run")
    run_trainer(tmp_path, model, tele, steps=8, optimizer=torch.optim.AdamW(model.parameters(), lr=2e-5))
    run = at.load_run(str(tmp_path / "run"), progress=False)
    assert run.meta["optimizer"] == "AcceleratedOptimizer"
    assert run.meta["low_precision"]["group_0"] == {"bfloat16": sum(p.numel() for p in model.parameters()),
                                                     "optimizer": "torch.optim.adamw.AdamW"}
    found = at.check_low_precision_updates(run)
    assert [f.code for f in found] == ["low_precision_updates"]
    cut = 2.0 ** round(math.log2(float(found[0].message.split("magnitude above ")[1].split(". ")[0])))
    w0 = torch.cat([before[n].reshape(-1) for n, _ in model.named_parameters()]).double()
    w = torch.cat([p.detach().reshape(-1) for _, p in model.named_parameters()]).double()
    assert (w0.abs() > cut).double().mean() > 0.5 and torch.equal(w[w0.abs() > cut], w0[w0.abs() > cut])
    small = w0.abs() < cut / 2
    assert (w[small] != w0[small]).double().mean() > 0.5


def test_trainer_counts_optimizer_steps_under_gradient_accumulation(tmp_path):
    model = lora_model()
    tele = new_telemetry(tmp_path / "run")
    trainer, logged = run_trainer(tmp_path, model, tele, steps=4, accumulation=2, logging_steps=2)
    records = read_records(str(tmp_path / "run"))
    assert trainer.state.global_step == 4  # 8 micro-batches
    assert [r["step"] for r in records] == [1, 2, 3, 4] == [r["batch_idx"] for r in records]
    # The Trainer logs steps 2 and 4: those records carry its grad_norm; 1 and 3 were written without.
    assert [("trainer" in r) for r in records] == [False, True, False, True]
    for before, r in zip(records[0::2], records[1::2]):
        assert rel(r["gradient_norm"]["overall"], logged[r["step"]]["grad_norm"]) < 1e-5
        assert r["batch_stats"]["batch_size"] == 4  # the step's last micro-batch
        # the step's 2 micro-batches, and at least their 2 backward() passes in the gradients (clipping adds one)
        assert r["accumulation"]["micro_batches"] == 2 and r["accumulation"]["backward_bound"] >= 2
        # a step took 2 micro-batches of 4 examples: throughput counts both
        assert r["system"]["examples_per_s"] * r["system"]["step_time_s"] == pytest.approx(8)
        # each record's loss covers its own 2 micro-batches; the Trainer logs the mean of 2 optimizer steps
        assert rel((before["loss"] + r["loss"]) / 2, logged[r["step"]]["loss"]) < 1e-5


def test_a_trainer_resumed_from_a_checkpoint_is_not_told_that_nothing_was_collected(tmp_path):
    """The Trainer saves at step 20, the run stops at step 30 (the process dies), and a new process resumes
    from checkpoint-20 into the same run directory, collecting every 2 steps. Telemetry warned "nothing
    collected in 21 steps" at the resumed run's first step that does not collect: its threshold was an
    absolute step (10 x collect_every_n), and the resumed count starts at 20. It counts from the first step
    this process sees; the records after the resume carry on at every second step."""
    class Stop(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 30:
                raise KeyboardInterrupt   # the process dies here; what was saved stays

    def trainer(model, tele, callbacks):
        args = TrainingArguments(output_dir=str(tmp_path / "hf"), per_device_train_batch_size=4, max_steps=40,
                                 learning_rate=1e-3, report_to=[], use_cpu=True, save_strategy="steps",
                                 save_steps=20, disable_tqdm=True, seed=0)
        t = Trainer(model=model, args=args, train_dataset=TokenDataset(), callbacks=[tele.hf_callback(), *callbacks])
        t.remove_callback(PrinterCallback)
        return t

    config = dict(output_dir=str(tmp_path / "run"), collect_every_n=2)
    first = TrainingTelemetry(TelemetryConfig(**config))
    with pytest.raises(KeyboardInterrupt):
        trainer(lora_model(), first, [Stop()]).train()
    del first   # as if its process had died: the run directory is free again
    gc.collect()
    tele = TrainingTelemetry(TelemetryConfig(**config))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer(lora_model(), tele, []).train(resume_from_checkpoint=str(tmp_path / "hf" / "checkpoint-20"))
        tele.close()
    assert not [str(w.message) for w in seen if "nothing collected" in str(w.message)]
    steps = [r["step"] for r in read_records(str(tmp_path / "run"))]
    assert steps[-10:] == list(range(22, 41, 2))


def test_hf_callback_is_one_trainer_callback():
    tele = TrainingTelemetry(enabled=False)
    assert isinstance(tele.hf_callback(), transformers.TrainerCallback)
    assert tele.hf_callback() is tele.hf_callback()


def test_telemetry_imports_without_transformers_or_peft():
    code = "import sys, telemetry; sys.exit(any(m in sys.modules for m in ('transformers', 'peft', 'unsloth')))"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


# ---- example_train.py ----------------------------------------------------------------------------------


def test_example_lora_run_learns_and_records_lora(tmp_path):
    sys.path.insert(0, ROOT)
    import example_train

    example_train.train_lora(str(tmp_path), max_steps=40, collect_every_n=10, quiet=True)
    records = read_records(str(tmp_path))
    assert [r["step"] for r in records] == [10, 20, 30, 40]
    assert all(r["trainer"]["grad_norm"] > 0 and r["lora"]["b_zero_fraction"] == 0.0 for r in records)
    assert records[-1]["loss"] < records[0]["loss"]
    assert records[-1]["lora"]["adapter_norm"]["overall"] > records[0]["lora"]["adapter_norm"]["overall"]
    assert len(records[0]["holdout_logits"]["token_logits"][0]) == 10
    assert set(records[0]["learning_rates"]) >= {"lora_A", "lora_B", "lm_head"}


def installed(*names):
    """Whether each package is there, without importing it: unsloth must not come after transformers."""
    import importlib.util
    return all(importlib.util.find_spec(n) is not None for n in names)


@pytest.mark.skipif(installed("unsloth"), reason="checks the message given where unsloth is not installed")
def test_example_unsloth_without_unsloth_exits_2_with_a_clear_message(tmp_path):
    proc = subprocess.run([sys.executable, "example_train.py", "--unsloth", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "pip install unsloth" in proc.stderr and "--lora" in proc.stderr


@pytest.mark.skipif(not installed("unsloth", "trl", "datasets"), reason="needs unsloth, trl and datasets")
def test_unsloth_run_against_peft_the_trainer_and_an_eval_pass(tmp_path):
    """tests/unsloth_check.py in a process of its own (unsloth first): unsloth's FastLanguageModel and TRL's
    SFTTrainer, on a GPU where there is one (else unsloth's CPU fallback): a healthy run, one at lr 0, one with
    unsloth's gradient checkpointing, one of 4 micro-batches a step, one whose holdout is padded before the text,
    and a 4-bit base where bitsandbytes imports. Where the model scores a line padded before its text otherwise than
    alone (unsloth's fast path on a GPU), padding_read says so, and that run alone has a finding."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run([sys.executable, os.path.join("tests", "unsloth_check.py"), str(tmp_path), "--steps", "30"],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(tmp_path / "results.json") as f:
        results = json.load(f)
    runs = {label: res for label, res in results.items() if isinstance(res, dict)}
    assert runs.keys() >= {"healthy", "lr0", "accumulation", "checkpointing", "left_padded"}  # and qlora
    assert results["healthy"]["base_layers"] == ["Linear"]
    for label, res in runs.items():
        assert "error" not in res, res.get("error")
        assert res["records"][-1] == res["trainer_steps"] and res["lora_modules"][0] == res["lora_modules"][1] == 14
        assert res["grad_norm_float64_rel_max"] < 1e-5  # against float64 square sums of the gradients backward left
        assert res["loss_rel_max"] < 1e-6  # the Trainer's logged loss: the mean of the step's micro-batches
        # The Trainer's own norm is summed in the gradients' dtype: bf16 adapters (QLoRA) put it 0.3% off float64.
        assert res["grad_norm_rel_max"] < (1e-2 if "torch.bfloat16" in res["trainable_dtypes"] else 1e-5)
        assert res["weight_norm_rel"] < 1e-5 and res["frozen_unchanged"] and res["reference_is_trainable_only"]
        assert res["holdout_kind"] == "lm" and res["holdout_n"] == [32, 32]
        assert res["holdout_nll_rel_max"] < 1e-4 and res["holdout_accuracy_abs_max"] < 1e-6
        # the most padded line's NLL in its batch and alone, against the same two passes of the final weights
        reference = res["padding_nll_reference"]
        assert res["padding_nll"] == pytest.approx(reference, rel=1e-4)
        reads = rel(*reference) > 3e-2 if label == "left_padded" else False
        if label != "left_padded":  # padding after the text, under a causal mask, changes nothing
            assert res["holdout_unpadded_nll_rel_max"] < 1e-3 and rel(*reference) < 1e-3
        elif not reads:  # each line scored as alone, to rounding (bf16 on a GPU: some 0.1%)
            assert rel(*reference) < 3e-3, reference  # between the two, the analyzer's median may go either way
            assert res["holdout_unpadded_nll_rel_max"] < 1e-2
        loud = {code for code, severity in res["every_finding"] if severity != "info"}
        assert ("padding_read" in loud) == reads, (label, reference, res["every_finding"])
        assert not res["check_failed"]
        if label == "qlora":  # the frozen base is bitsandbytes' 4-bit layers, which the records leave alone
            assert res["base_layers"] == ["Linear4bit"]
        if label == "lr0":
            assert res["adapter_norm"] == [0.0, 0.0]
            assert res["findings"][0][0] == "lr_zero" and "lora_not_learning" in {c for c, _ in res["every_finding"]}
        else:
            assert res["adapter_norm_rel"] < 1e-4 and res["adapter_norm_layer_rel_max"] < 1e-4
            assert res["adapter_norm_float64_rel"] < 1e-6  # peft's product is formed in the adapters' dtype
            assert res["final_loss"] < res["first_loss"]
            assert loud == ({"padding_read"} if reads else set()), res["every_finding"]
        if results["device"] != "cpu":  # the record's peak is the process's at that step, at most the final one
            system = res["system"]
            assert 0 < system["cuda_allocated_mb"] <= system["cuda_peak_mb"]
            assert system["cuda_peak_mb"] <= res["torch_max_memory_allocated_mb"] + 1e-6


def test_trainer_drift_counts_the_first_step(tmp_path):
    """The callback keeps W_0 when training begins, so drift is the distance from the weights before the
    first step (against float64 copies taken then and after each step), not from those after it."""
    from transformers import TrainerCallback

    model = lora_model()
    trainable = [p for p in model.parameters() if p.requires_grad]
    start = [p.detach().double().clone() for p in trainable]
    after = {}

    class Copies(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            after[state.global_step] = [p.detach().double().clone() for p in trainable]

    tele = new_telemetry(tmp_path / "run")
    args = TrainingArguments(output_dir=str(tmp_path / "hf"), per_device_train_batch_size=4, max_steps=3,
                             logging_steps=1, learning_rate=1e-2, report_to=[], use_cpu=True, save_strategy="no",
                             disable_tqdm=True, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=TokenDataset(), callbacks=[tele.hf_callback(), Copies()])
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    for r in read_records(str(tmp_path / "run")):
        want = math.sqrt(sum(float((a - b).square().sum()) for a, b in zip(after[r["step"]], start)))
        assert want > 0 and rel(r["drift"]["overall"], want) < 1e-5


def test_gradient_hooks_are_there_only_for_the_steps_that_collect(tmp_path):
    """Collecting every 2nd optimizer step, with clipping and 2 micro-batches a step: the hooks that read the
    norms before clipping are on the tensors during steps 2 and 4 only, so the other steps' backward passes
    call no Python; the records still hold the Trainer's logged pre-clip grad_norm."""
    model = lora_model()
    tele = TrainingTelemetry(TelemetryConfig(output_dir=str(tmp_path / "run"), collect_every_n=2, strict=True))
    hooked = {}

    class Probe(TrainerCallback):  # after the step's backward passes, before clipping and the optimizer
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            hooked[state.global_step + 1] = any(p._post_accumulate_grad_hooks for p in model.parameters())

    args = TrainingArguments(output_dir=str(tmp_path / "hf"), per_device_train_batch_size=4, max_steps=4,
                             gradient_accumulation_steps=2, logging_steps=1, learning_rate=1e-2, max_grad_norm=0.05,
                             report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=TokenDataset(), callbacks=[tele.hf_callback(), Probe()])
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    logged = {h["step"]: h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h}
    records = read_records(str(tmp_path / "run"))
    assert hooked == {1: False, 2: True, 3: False, 4: True}
    assert [r["step"] for r in records] == [2, 4] and min(logged.values()) > 0.1
    for r in records:
        assert rel(r["gradient_norm"]["overall"], logged[r["step"]]) < 1e-5
    assert not any(p._post_accumulate_grad_hooks for p in model.parameters())


def test_trainer_clipping_records_the_norm_before_it(tmp_path):
    """max_grad_norm 0.05, under every step's norm, with 2 micro-batches a step: the records hold the norms
    before clipping, equal to the Trainer's logged grad_norm (which it takes there), not the clipped 0.05.
    The gradient hooks are gone after training."""
    model = lora_model()
    tele = new_telemetry(tmp_path / "run")
    args = TrainingArguments(output_dir=str(tmp_path / "hf"), per_device_train_batch_size=4, max_steps=4,
                             gradient_accumulation_steps=2, logging_steps=1, learning_rate=1e-2, max_grad_norm=0.05,
                             report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=TokenDataset(), callbacks=[tele.hf_callback()])
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    logged = {h["step"]: h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h}
    records = read_records(str(tmp_path / "run"))
    assert [r["step"] for r in records] == [1, 2, 3, 4] and min(logged.values()) > 0.1
    for r in records:
        assert rel(r["gradient_norm"]["overall"], logged[r["step"]]) < 1e-5
        groups = [v for k, v in r["gradient_norm"].items() if k in ("lora_A", "lora_B")]
        assert rel(math.hypot(*groups), logged[r["step"]]) < 1e-5
    assert not any(p._post_accumulate_grad_hooks for p in model.parameters())
    assert json.loads((tmp_path / "run" / "run.json").read_text())["clip_grad_norm"] == 0.05


def test_conv_and_embedding_adapters_against_get_delta_weight(tmp_path):
    """Adapters of several shapes and kinds in one model (two convolutions, an embedding, linears), each kind
    stacked apart: adapter_norm, adapter_delta and the A and B gradient norms against peft's get_delta_weight
    and torch's get_total_norm."""
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(20, 6)
            self.conv1, self.conv2 = torch.nn.Conv2d(6, 8, 3, padding=1), torch.nn.Conv2d(8, 8, 3, padding=1)
            self.fc1, self.fc2 = torch.nn.Linear(8, 8), torch.nn.Linear(8, 5)

        def forward(self, ids):
            x = self.emb(ids).permute(0, 3, 1, 2)  # [n, 6, h, w]
            x = self.conv2(torch.relu(self.conv1(x))).mean((2, 3))
            return self.fc2(torch.relu(self.fc1(x)))

    torch.manual_seed(0)
    model = get_peft_model(Net(), LoraConfig(r=3, lora_alpha=6, target_modules=["emb", "conv1", "conv2", "fc1", "fc2"]))
    randomize_adapters(model, 2)
    for name, p in model.named_parameters():
        if "lora_embedding" in name:
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.3)
    layers = lora_layers(model)
    assert len(layers) == 5
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    tele = new_telemetry(tmp_path)
    ids = torch.randint(0, 20, (4, 5, 5), generator=torch.Generator().manual_seed(1))
    target = torch.randint(0, 5, (4,), generator=torch.Generator().manual_seed(2))
    for step in (1, 2, 3):
        before = dense_deltas(model)
        torch.nn.functional.cross_entropy(model(ids), target).backward()
        grads = {k: [p.grad for n, p in model.named_parameters() if f"lora_{k}" in n or f"lora_embedding_{k}" in n]
                 for k in "AB"}
        optimizer.step()
        lora = tele.on_batch_end(model, optimizer, step, 0)["lora"]
        optimizer.zero_grad()
        after = dense_deltas(model)
        assert lora["modules"] == 5
        dense = math.sqrt(sum(float(d.square().sum()) for d in after.values()))
        assert rel(lora["adapter_norm"]["overall"], dense) < 1e-6
        if step > 1:
            moved = math.sqrt(sum(float((after[n] - before[n]).square().sum()) for n in after))
            assert moved > 0 and rel(lora["adapter_delta"]["overall"], moved) < 1e-6
        for k in "AB":
            assert len(grads[k]) == 5
            assert rel(lora[f"grad_norm_{k}"], float(torch.nn.utils.get_total_norm(grads[k]))) < 1e-5
