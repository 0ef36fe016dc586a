"""example_train.py's unsloth LoRA fine-tune, its records checked against independent references: the adapters'
norms against peft's get_delta_weight and s*B*A in float64, the gradient norm against float64 sums of the
gradients and the Trainer's own logged grad_norm, the loss against the Trainer's, the LM holdout against an
eval() pass of the trained model over the same batch and over each line alone, the padding probe against the
same, the CUDA memory figures against torch.cuda.max_memory_allocated, and the analyzer's findings. Runs: a
healthy one, one at lr 0, one with unsloth's gradient checkpointing, one of 4 micro-batches a step, one whose
holdout is padded before the text, and with bitsandbytes a 4-bit base (QLoRA). Prints one JSON object of measured errors and
writes it to OUT/results.json.

    python tests/unsloth_check.py OUT    # unsloth, trl and datasets; a CUDA GPU, or unsloth's CPU fallback

tests/test_lora.py runs it where unsloth is installed (`make test-unsloth`) and holds the errors to their bounds."""
import argparse
import json
import math
import os
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args(argv)
    import unsloth  # noqa: F401  before transformers and peft, which it patches
    import torch

    sys.path.insert(0, ROOT)
    import example_train

    os.makedirs(args.out, exist_ok=True)
    results = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if torch.cuda.is_available()
               else "cpu"}
    from importlib import metadata

    for name in ("unsloth", "unsloth_zoo", "transformers", "peft", "trl", "datasets", "bitsandbytes"):
        try:
            results[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            results[name] = "missing"
    model_dir = example_train.save_tiny_llama(os.path.join(args.out, "tiny-llama"))

    def save():
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump(results, f, indent=1)

    # (label, the trainer's arguments, the model's): a healthy run, one at lr 0, unsloth's own gradient
    # checkpointing, 4 micro-batches a step, and a 4-bit base (QLoRA) where bitsandbytes imports.
    runs = [("healthy", dict(max_steps=args.steps), {}),
            ("lr0", dict(learning_rate=0.0, max_steps=20), {}),
            ("accumulation", dict(accumulation=4, max_steps=20), {})]
    runs.append(("checkpointing", dict(max_steps=20), dict(checkpointing="unsloth")))
    runs.append(("left_padded", dict(max_steps=20, padding_side="left"), {}))  # a holdout padded before the text
    try:
        import bitsandbytes  # noqa: F401
        runs.append(("qlora", dict(max_steps=20), dict(load_in_4bit=True)))
    except Exception as exc:  # not installed, or no kernels for this machine
        results["bitsandbytes"] += f" (no QLoRA run: {type(exc).__name__}: {exc})"
    for label, train, build_args in runs:
        started = time.time()
        try:
            results[label] = check_run(example_train, model_dir, os.path.join(args.out, label), build_args, train)
        except Exception:
            results[label] = {"error": traceback.format_exc()[-3000:]}
        results[label]["seconds"] = round(time.time() - started, 1)
        save()
    print(json.dumps(results, indent=1))
    return 0


def rel(a, b):
    return abs(a - b) / abs(b) if b else abs(a - b)


def check_run(example_train, model_dir, out, build_args, train):
    import torch
    from peft.tuners.lora import LoraLayer

    import analyze_telemetry as at
    import telemetry

    model, tokenizer = example_train.unsloth_model(model_dir, **build_args)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    train = dict(train)
    held = example_train.sft_holdout(tokenizer, padding_side=train.pop("padding_side", "right"))
    trainer = example_train.sft_trainer(model, tokenizer, out, holdout=held, **train)
    # An independent reference: each trainable gradient's float64 square sum as the step's last backward leaves
    # it, before the Trainer clips (global_step counts the steps taken, so the one being computed is one more;
    # under accumulation a later micro-batch's value replaces an earlier one's).
    last = {}

    def keep(p):
        last.setdefault(trainer.state.global_step + 1, {})[id(p)] = float(p.grad.double().square().sum())

    hooks = [p.register_post_accumulate_grad_hook(keep) for p in model.parameters() if p.requires_grad]
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    for h in hooks:
        h.remove()
    squares = {step: sum(values.values()) for step, values in last.items()}
    with open(os.path.join(out, "telemetry.jsonl")) as f:
        records = [json.loads(line) for line in f]
    logged = {h["step"]: h for h in trainer.state.log_history if "grad_norm" in h}
    res = {"records": [r["step"] for r in records], "trainer_steps": trainer.state.global_step,
           "final_loss": records[-1]["loss"], "first_loss": records[0]["loss"]}

    # The gradient norm at each collected optimizer step against the Trainer's own (before clipping).
    res["grad_norm_rel_max"] = max(rel(r["gradient_norm"]["overall"], float(logged[r["step"]]["grad_norm"]))
                                   for r in records)
    res["loss_rel_max"] = max(rel(r["loss"], float(logged[r["step"]]["loss"])) for r in records)
    res["grad_norm_float64_rel_max"] = max(rel(r["gradient_norm"]["overall"], math.sqrt(squares[r["step"]]))
                                           for r in records)
    res["trainer_vs_float64_rel_max"] = max(rel(float(logged[r["step"]]["grad_norm"]), math.sqrt(squares[r["step"]]))
                                            for r in records)
    res["trainable_dtypes"] = sorted({str(p.dtype) for p in model.parameters() if p.requires_grad})

    # The adapters at the last step (the model as training left it) against peft's dense delta weights.
    last = records[-1]
    assert last["step"] == trainer.state.global_step, "the last optimizer step was not collected"
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, LoraLayer)]
    dense = {n: m.get_delta_weight("default").detach().double() for n, m in layers}
    total = math.sqrt(sum(float(d.square().sum()) for d in dense.values()))
    lora = last["lora"]
    res["lora_modules"] = (lora["modules"], len(layers))
    res["base_layers"] = sorted({type(m.base_layer).__name__ for _, m in layers})
    res["adapter_norm"] = (lora["adapter_norm"]["overall"], total)
    res["adapter_norm_rel"] = rel(lora["adapter_norm"]["overall"], total) if total else None
    # and against s*B*A formed in float64 (get_delta_weight multiplies in the adapters' dtype, bf16 under QLoRA)
    exact = math.sqrt(sum(float((m.scaling["default"] * m.lora_B["default"].weight.double()
                                 @ m.lora_A["default"].weight.double()).square().sum()) for _, m in layers))
    res["adapter_norm_float64_rel"] = rel(lora["adapter_norm"]["overall"], exact) if exact else None
    per_layer = {}
    for n, d in dense.items():
        key = f"layer_{int(n.split('.layers.')[1].split('.')[0])}"
        per_layer[key] = per_layer.get(key, 0.0) + float(d.square().sum())
    res["adapter_norm_layer_rel_max"] = max(
        (rel(lora["adapter_norm"][k], math.sqrt(v)) for k, v in per_layer.items() if v), default=None)
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    norm = math.sqrt(sum(float(p.detach().double().square().sum()) for p in trained.values()))
    res["weight_norm_rel"] = rel(last["weight_norm"]["overall"], norm)

    # The frozen base, 4-bit or not, is as it was, and the reference file holds the adapters alone.
    params = dict(model.named_parameters())
    res["frozen_unchanged"] = all(torch.equal(p, params[n]) for n, p in frozen.items())
    from safetensors import safe_open
    with safe_open(os.path.join(out, telemetry.REFERENCE_FILE), "pt") as f:
        res["reference_is_trainable_only"] = set(f.keys()) == set(trained)

    # The LM holdout: per-example NLL and token accuracy against an eval() pass of the same model over the same
    # padded batch, logits in float64; and against each line alone, unpadded (what the model makes of the text).
    hold = last["holdout_logits"]
    batch = {k: v.to(next(model.parameters()).device) for k, v in held.items()}
    was_training = model.training
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.double()
        keep = [batch["attention_mask"][i] == 1 for i in range(len(logits))]
        alone = [model(input_ids=batch["input_ids"][i][k][None]).logits[0].double() for i, k in enumerate(keep)]
    model.train(was_training)

    def scored(logits, labels, mask):
        # each supervised next token, predicted at a position of the text (a left-padded line's first token is
        # predicted at padding, which an unpadded line has none of)
        lp = torch.log_softmax(logits[:-1], -1)
        valid = (labels[1:] != -100) & (mask[:-1] == 1)
        return (float(-lp[valid].gather(1, labels[1:][valid][:, None]).mean()),
                float((logits[:-1][valid].argmax(-1) == labels[1:][valid]).double().mean()))

    padded = [scored(x, y, m) for x, y, m in zip(logits, batch["labels"], batch["attention_mask"])]
    unpadded = [scored(x, batch["labels"][i][k], batch["attention_mask"][i][k])
                for i, (x, k) in enumerate(zip(alone, keep))]
    res["holdout_kind"] = hold.get("kind")
    res["holdout_n"] = (len(hold["nll"]), len(padded))
    res["holdout_nll_rel_max"] = max(rel(a, b[0]) for a, b in zip(hold["nll"], padded))
    res["holdout_accuracy_abs_max"] = max(abs(a - b[1]) for a, b in zip(hold["token_accuracy"], padded))
    res["holdout_mean_accuracy"] = sum(b[1] for b in padded) / len(padded)
    res["holdout_unpadded_nll_rel_max"] = max(rel(a[0], b[0]) for a, b in zip(padded, unpadded))
    # The padding probe: the most padded line (the first of them) in the batch and alone, at the tokens both score.
    row = int((batch["attention_mask"] == 0).sum(1).argmax())
    target = batch["labels"][row][keep[row]][1:]
    res["padding_nll"] = hold.get("padding_nll")
    res["padding_nll_reference"] = [float(torch.nn.functional.cross_entropy(x[:-1], target))
                                    for x in (logits[row][keep[row]], alone[row])]

    # CUDA memory: the record's peak is the process's peak at that step, at most the peak after training.
    system = last.get("system", {})
    res["system"] = {k: v for k, v in system.items() if "cuda" in k}
    if torch.cuda.is_available():
        res["torch_max_memory_allocated_mb"] = torch.cuda.max_memory_allocated() / 2**20

    run = at.load_run(out, progress=False)
    found = at.diagnose(run)
    res["findings"] = [(f.code, f.severity) for f in found]
    res["every_finding"] = [(f.code, f.severity) for f in at.every_finding(found)]
    res["check_failed"] = [n for n in run.notices if at.CHECK_FAILED in n]
    del trainer, model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return res


if __name__ == "__main__":
    sys.exit(main())
