#!/usr/bin/env python3
"""The weight pass and the reference's write alone, on GPT-2 small's weights on a GPU, for this telemetry.py and
another in one process; and this one's pass at other DEVICE_BLOCK_BYTES.

    python bench/gpu_pass.py --baseline OLD_TELEMETRY_PY [--json FILE]
    python bench/gpu_pass.py --from-json FILE      # print an earlier run's figures

GPT-2 small (124M parameters, float32) built from transformers' GPT2Config() on the GPU; its weights written as
the reference, and its weights plus 0.01 as the initial weights. Each figure is the median of 5 timed calls
after one untimed, the device synchronised before and after each: streamed_weight_changes (the pass over the
weights and both files), write_tensor_file with that pass as its `meanwhile` (what a collection does), and
write_tensor_file alone. drift_rel_err: the pass's sum of ||w - w0||^2 against float64 sums of the same tensors.
Without a GPU it runs on the CPU, on a 2-layer GPT-2 (a smoke run: there the pass is the CPU's).
"""
import argparse
import json
import os
import sys
import tempfile
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH)
sys.path.insert(0, BENCH)
from ab_collection import load  # noqa: E402


def median_ms(fn, sync, reps=5):
    fn()
    times = []
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", help="another telemetry.py, measured the same way")
    p.add_argument("--blocks", nargs="+", type=int, default=[2, 4, 32], help="DEVICE_BLOCK_BYTES to try, in MiB")
    p.add_argument("--json", help="write the figures to this file")
    p.add_argument("--from-json", help="print the figures of this --json file instead of measuring")
    args = p.parse_args()
    if args.from_json:
        with open(args.from_json) as f:
            for key, value in json.load(f).items():
                if isinstance(value, float):
                    value = f"{value:.2e}" if key.startswith("drift") else f"{value:.1f} ms"
                print(f"- {key}: {value}")
        return
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    versions = [("new", load("telemetry_new", os.path.join(REPO, "telemetry.py")))]
    if args.baseline:
        versions.insert(0, ("old", load("telemetry_old", args.baseline)))
    new = versions[-1][1]
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()
    named = list(GPT2LMHeadModel(GPT2Config() if dev.type == "cuda" else GPT2Config(n_layer=2)).to(dev)
                 .named_parameters())
    tmp = tempfile.mkdtemp()
    ref, init = os.path.join(tmp, "ref"), os.path.join(tmp, "init")
    new.write_tensor_file(ref, named)
    new.write_tensor_file(init, [(n, w + 0.01) for n, w in named])
    inits = new.map_tensor_file(init, [n for n, _ in named])[0]
    want = sum(float((w.detach().double() - w0.to(dev).double()).square().sum()) for (_, w), w0 in zip(named, inits))
    res = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "torch": torch.__version__}
    for label, T in versions:
        with torch.no_grad():
            got = T.streamed_weight_changes(named, ref, init)
        res[f"drift_rel_err_{label}"] = abs(float(got["drift_sq"].double().sum()) - want) / want
        res[f"pass_{label}"] = median_ms(lambda: T.streamed_weight_changes(named, ref, init), sync)
        res[f"collection_{label}"] = median_ms(lambda: T.write_tensor_file(
            ref, named, meanwhile=lambda put: T.streamed_weight_changes(named, ref, init)), sync)
    kept = new.DEVICE_BLOCK_BYTES
    for mib in args.blocks:
        new.DEVICE_BLOCK_BYTES = mib << 20
        res[f"pass_new_block{mib}M"] = median_ms(lambda: new.streamed_weight_changes(named, ref, init), sync)
    new.DEVICE_BLOCK_BYTES = kept
    res["write_new"] = median_ms(lambda: new.write_tensor_file(ref, named), sync)
    print(json.dumps(res, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
