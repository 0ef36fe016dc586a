"""This telemetry.py against the one in a git revision, collecting on the same model in one process.

    python bench/ab_collection.py --baseline REV [--workload cnn|mlp|lora256|lora_deep] [--pairs 400]
                                  [--param-change]

lora_deep: the LoRA workload's Llama at 32 layers of width 64 with rank-8 adapters on all seven projections
(see compare.build_lora).

Both versions are loaded as modules, each with a TrainingTelemetry (the default config, no holdout; with
--param-change, track_param_change on, whose counts the weight pass adds) writing to a directory of its own.
Every round trains one step and collects with one version, then another step and the other version, the
order swapped each round, so that both see the same machine state; the hook is timed
alone. Prints each version's median collection and the median over rounds of the per-round ratio
this / REV, the figure that the machine's drift between rounds cancels out of. Each version's fused kernels
are compiled (one after the other: two compiles at once in one process interfere) before the timed rounds.
"""

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH)
sys.path.insert(0, BENCH)
from compare import build_workload  # noqa: E402  (the benchmark's own workloads)


def load(name, path):
    """The Python file at `path` imported as module `name`."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def telemetry_at(revision, directory):
    """The path of git revision `revision`'s telemetry.py, written into `directory`."""
    path = os.path.join(directory, "telemetry_baseline.py")
    with open(path, "wb") as f:
        f.write(subprocess.run(["git", "-C", REPO, "show", f"{revision}:telemetry.py"], check=True,
                               capture_output=True).stdout)
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", required=True, help="git revision whose telemetry.py is compared")
    parser.add_argument("--workload", choices=("cnn", "mlp", "lora256", "lora_deep"), default="cnn")
    parser.add_argument("--pairs", type=int, default=400)
    parser.add_argument("--compile-timeout", type=float, default=600.0)
    parser.add_argument("--param-change", action="store_true", help="track_param_change on in both versions")
    args = parser.parse_args(argv)
    torch.set_num_threads(os.cpu_count() or 1)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        versions = {"this": load("telemetry_this", os.path.join(REPO, "telemetry.py")),
                    args.baseline: load("telemetry_baseline", telemetry_at(args.baseline, tmp))}
        wl = build_workload(args.workload)
        model = wl.model
        opt = wl.opt = wl.opt_factory(model.parameters())
        runs = {name: module.TrainingTelemetry(module.TelemetryConfig(
            output_dir=os.path.join(tmp, name.replace("/", "_")), collect_every_n=1, track_holdout_logits=False,
            track_param_change=args.param_change))
            for name, module in versions.items()}
        k = [0]

        def collect(name):
            batch, loss = wl.train_step(k[0])
            k[0] += 1
            start = time.perf_counter()
            runs[name].on_batch_end(model, opt, k[0], 0, batch=batch, loss=loss)
            return time.perf_counter() - start

        for name, module in versions.items():  # first collections, then each compile, one at a time
            collect(name)
            start = time.perf_counter()
            while module._FUSED.compiling and time.perf_counter() - start < args.compile_timeout:
                time.sleep(0.05)
        for name in versions:  # the second collection creates the reference's spare file
            collect(name)
        times = {name: [] for name in versions}
        for r in range(args.pairs):
            for name in (list(versions) if r % 2 == 0 else list(versions)[::-1]):
                times[name].append(collect(name))
        for run in runs.values():
            getattr(run, "close", lambda: None)()
    params = sum(p.numel() for p in model.parameters())
    print(f"{args.workload}: {params / 1e6:.2f}M parameters; torch {torch.__version__}; {args.pairs} rounds"
          + ("; track_param_change on" if args.param_change else ""))
    for name, values in times.items():
        print(f"  {name}: median {statistics.median(values) * 1e3:.2f} ms per collection "
              f"(min {min(values) * 1e3:.2f}, mean {statistics.mean(values) * 1e3:.2f})")
    ratios = [a / b for a, b in zip(times["this"], times[args.baseline])]
    print(f"RATIO this / {args.baseline}, median per round: {statistics.median(ratios):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
