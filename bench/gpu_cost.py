#!/usr/bin/env python3
"""What a collection costs on a GPU, against the step time and against wandb.watch(log="all"), in one process.

    python bench/gpu_cost.py [--workloads gpt2 llama_lora] [--block 20] [--rounds 6] [--json FILE]
    python bench/gpu_cost.py --quick --device cpu     # a smoke run of this script, on tiny models

Workloads, each training in bf16 (autocast) on random tokens, batch 8 x 512:
  gpt2        GPT-2 small built from transformers' GPT2Config() (124M parameters, float32 weights), every
              parameter trained with AdamW;
  llama_lora  a Llama built from a config (hidden 1024, 8 layers, vocab 32000, 166M parameters) with its
              weights in bf16 and frozen, and a peft LoRA (r=16) on every projection, trained with AdamW.
For each workload, in one process: telemetry.py's hook (default config, no holdout) at every step and at every
16th, and wandb.watch(log="all", log_freq=1) in offline mode with the loss logged at every step, each switched
on and off in alternating blocks of --block steps (an off block has no hook, and wandb's hooks removed); the
ratio is a round's median step time with it on over that of the off block beside it, whose order alternates,
and the table gives the median over --rounds rounds. Every step ends with loss.item(), so a step's time
includes the device's work. A first block, untimed, holds each configuration's first collections: they write
the references and, with TELEMETRY_COMPILE=1, compile the fused kernels (a once-per-process cost, measured by
collection_cost.py).

Then where one collection's time goes: the hook timed alone (the device synchronised before and after), and
each section with the device synchronised around it, with the reference file's write, the pass over the weights
and their files, and the record's one transfer to the host timed inside them (where the pass runs beside the
write, write_tensor_file's time includes it). These timed collections are not
the blocks' ones: synchronising adds waits that an unsynchronised loop overlaps.
`--telemetry PATH` measures another telemetry.py (say, a revision's) the same way. `--from-json FILE` prints the
tables of an earlier run's --json file, and `--baseline-json FILE` adds, for each workload both measured, how
our every-step collection compares with that run's.
"""

import argparse
import collections
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH)
sys.path.insert(0, BENCH)
from ab_collection import load  # noqa: E402
from compare import (Workload, alternating_round, block_steps, patched, setup_config, timing_wrapper,  # noqa: E402
                     toggles)

CONFIGS = ("ours:1", "ours:16", "wandb_all:1")


def build(name, device, quick):
    """The workload `name` on `device`: a compare.Workload whose loss runs under bf16 autocast."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    batch, seq = (2, 32) if quick else (8, 512)
    if name == "gpt2":
        cfg = GPT2Config(n_layer=2, n_embd=128, n_head=2) if quick else GPT2Config()
        model, vocab = GPT2LMHeadModel(cfg).to(device), cfg.vocab_size
        trainable = list(model.parameters())
    elif name == "llama_lora":
        from peft import LoraConfig, get_peft_model

        hidden, layers = (128, 2) if quick else (1024, 8)
        cfg = LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                          num_hidden_layers=layers, num_attention_heads=hidden // 64,
                          num_key_value_heads=hidden // 64, max_position_embeddings=seq)
        base = LlamaForCausalLM(cfg).to(device, torch.bfloat16)
        model = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM",
                                                target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                "gate_proj", "up_proj", "down_proj"]))
        vocab = cfg.vocab_size
        trainable = [p for p in model.parameters() if p.requires_grad]
    else:
        raise SystemExit(f"unknown workload {name!r}")

    def tokens():
        ids = torch.randint(0, vocab, (batch, seq), device=device)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}

    def loss_fn(m, b):
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
            out = m(**b)
        return out.loss, out.logits

    wl = Workload(name, model, lambda params: torch.optim.AdamW([p for p in params if p.requires_grad], lr=1e-4),
                  [tokens() for _ in range(4)], tokens(), loss_fn, lambda m, h: loss_fn(m, h)[1])
    wl.info = {"parameters": sum(p.numel() for p in model.parameters()),
               "trainable": sum(p.numel() for p in trainable),
               "trainable_bytes": sum(p.numel() * p.element_size() for p in trainable), "batch": [batch, seq]}
    return wl


def blocks(wl, config, interval, block, rounds, tmp):
    """Alternating on/off blocks of one configuration on this process's model: ratios and step times."""
    setup = setup_config(config, interval, wl, tmp)
    pause, resume = toggles(config, wl, interval)
    step = wl.step
    block_steps(wl, setup.hook, step, block)  # the first collections write the references (and compile)
    step += block
    ratios, on_ms, off_ms = [], [], []
    for r in range(rounds):
        means, step = alternating_round(wl, setup.hook, pause, resume, step, block, r)
        ratios.append(means[True] / means[False])
        on_ms.append(1e3 * means[True])
        off_ms.append(1e3 * means[False])
    if pause:
        pause()
    wl.step = step
    result = {"config": config, "interval": interval, "ratio_median": statistics.median(ratios),
              "ratio_min": min(ratios), "ratio_max": max(ratios), "step_on_ms": statistics.median(on_ms),
              "step_off_ms": statistics.median(off_ms)}
    return result, setup


def where_time_goes(wl, setup, telemetry, collections_n, sync):
    """The hook alone, then per section and inside the weight section, each with the device synchronised."""
    hook_ms = []
    for k in range(collections_n):
        step = wl.step + k + 1
        batch = wl.batches[step % len(wl.batches)]
        loss, _ = wl.loss_fn(wl.model, batch)
        loss.backward()
        wl.opt.step()
        sync()
        t0 = time.perf_counter()
        setup.hook(step, batch, loss)
        sync()
        hook_ms.append(1e3 * (time.perf_counter() - t0))
        wl.opt.zero_grad(set_to_none=True)
    wl.step += collections_n

    parts = collections.defaultdict(list)

    def into(name):
        return lambda seconds: parts[name].append(1e3 * seconds)

    original_run = telemetry._Collection.run

    def run(c, section, fn, *args):
        return timing_wrapper(original_run, into(f"section {section}"), sync)(c, section, fn, *args)
    replacements = {(telemetry, name): timing_wrapper(getattr(telemetry, name), into(name), sync)
                    for name in ("write_tensor_file", "streamed_weight_changes", "host_record")}
    with patched({(telemetry._Collection, "run"): run, **replacements}):
        block_steps(wl, setup.hook, wl.step, collections_n)
        wl.step += collections_n
    return {"hook_ms": statistics.median(hook_ms),
            "parts_ms": {k: statistics.median(v) * len(v) / collections_n for k, v in sorted(parts.items())}}


def measure(name, args):
    import torch

    device = args.device
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    wl = build(name, device, args.quick)
    wl.opt = wl.opt_factory(wl.model.parameters())
    wl.step = 0
    block_steps(wl, None, 0, args.block)  # warm the allocator, cuBLAS and autocast's caches
    wl.step = args.block
    out = {"workload": name, **wl.info, "configs": []}
    for config, interval in (c.split(":") for c in args.configs):
        interval = int(interval)
        with tempfile.TemporaryDirectory(prefix=f"gpu-cost-{name}-{config}-") as tmp:
            try:
                result, setup = blocks(wl, config, interval, args.block, args.rounds, tmp)
                if config == "ours" and interval == 1:
                    result.update(where_time_goes(wl, setup, sys.modules["telemetry"], args.collections, sync))
                    records = os.path.join(tmp, "telemetry.jsonl")
                    with open(records) as f:
                        last = json.loads(f.readlines()[-1])
                    result["telemetry_ms_last_record"] = last.get("telemetry_ms")
                setup.close()
            except Exception as exc:  # one peer failing (say, wandb missing) leaves the others' figures
                result = {"config": config, "interval": interval, "error": f"{type(exc).__name__}: {exc}"}
        out["configs"].append(result)
        print(json.dumps({"workload": name, **result}), flush=True)
    del wl
    if device.startswith("cuda"):
        out["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
        torch.cuda.empty_cache()
    return out


def baseline_lines(results, baseline):
    """Our every-step hook and ratio in this run against those of the `baseline` run, workload by workload."""
    def every_step(run):
        return {w["workload"]: next(c for c in w["configs"] if c["config"] == "ours" and c["interval"] == 1)
                for w in run["results"]}
    base = every_step(baseline)
    lines = [f"Against {baseline['telemetry']} (telemetry.py sha1 {baseline.get('telemetry_sha1', '?')}), "
             "measured the same way in the same call:", "",
             "| workload | hook alone (ms): this / baseline | ratio: this / baseline |", "|---|---|---|"]
    for name, c in every_step(results).items():
        if name in base and "hook_ms" in c and "hook_ms" in base[name]:
            b = base[name]
            lines.append(f"| {name} | {c['hook_ms']:.1f} / {b['hook_ms']:.1f} = {c['hook_ms'] / b['hook_ms']:.2f}x | "
                         f"x{c['ratio_median']:.3f} / x{b['ratio_median']:.3f} |")
    return lines


def table(results):
    lines = ["| workload | configuration | step off (ms) | step on (ms) | ratio (min-max) | hook alone (ms) |",
             "|---|---|---|---|---|---|"]
    for w in results:
        for c in w["configs"]:
            label = f"{'ours' if c['config'] == 'ours' else 'wandb.watch(all)'} every {c['interval']}"
            if "error" in c:
                lines.append(f"| {w['workload']} | {label} | {c['error']} | | | |")
                continue
            hook = f"{c['hook_ms']:.1f}" if "hook_ms" in c else ""
            lines.append(f"| {w['workload']} | {label} | {c['step_off_ms']:.1f} | {c['step_on_ms']:.1f} | "
                         f"x{c['ratio_median']:.3f} ({c['ratio_min']:.3f}-{c['ratio_max']:.3f}) | {hook} |")
    lines += ["", "Where one collection's time goes (ms, device synchronised around each part):", ""]
    for w in results:
        for c in w["configs"]:
            if "parts_ms" in c:
                lines.append(f"- {w['workload']}: " + ", ".join(f"{k} {v:.1f}" for k, v in c["parts_ms"].items()))
    return "\n".join(lines)


def _sha1(path):
    with open(path, "rb") as f:
        return hashlib.sha1(f.read()).hexdigest()[:12]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", nargs="+", default=["gpt2", "llama_lora"])
    p.add_argument("--device", default="cuda")
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), help="CONFIG:INTERVAL, CONFIG as compare.py's")
    p.add_argument("--block", type=int, default=20)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--collections", type=int, default=10, help="collections timed alone and by section")
    p.add_argument("--quick", action="store_true", help="tiny models, few steps: a smoke run of the script")
    p.add_argument("--telemetry", default=os.path.join(REPO, "telemetry.py"), help="the telemetry.py measured")
    p.add_argument("--json", help="write every figure to this file")
    p.add_argument("--from-json", help="print the tables of this --json file instead of measuring")
    p.add_argument("--baseline-json", help="with --from-json: compare with this --json file's run")
    args = p.parse_args()
    if args.from_json:
        with open(args.from_json) as f:
            run = json.load(f)
        print(f"{run['device']}, torch {run['torch']}, {run['telemetry']} (sha1 {run.get('telemetry_sha1', '?')}), "
              f"blocks of {run['block']} steps, {run['rounds']} rounds:")
        print()
        print(table(run["results"]))
        if args.baseline_json:
            with open(args.baseline_json) as f:
                print("\n" + "\n".join(baseline_lines(run, json.load(f))))
        return
    if args.quick:
        args.block, args.rounds, args.collections = 3, 2, 2
    load("telemetry", args.telemetry)  # what setup_config's `import telemetry` then finds
    import torch

    started = time.perf_counter()
    results = [measure(name, args) for name in args.workloads]
    head = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device,
            "torch": torch.__version__, "telemetry": os.path.relpath(args.telemetry, REPO),
            "telemetry_sha1": _sha1(args.telemetry), "block": args.block, "rounds": args.rounds,
            "minutes": round((time.perf_counter() - started) / 60, 1)}
    print(json.dumps(head))
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**head, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
