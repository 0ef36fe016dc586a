"""Per-collection cost of TelemetryConfig.comprehensive() against the default, on a ~50M-parameter MLP.

    python bench/dynamics_cost.py [--repeats 5] [--width 4096]

Same model as bench/compare.py's "mlp" workload (4096 -> 4096 x3 -> 10, 50.4M float32 parameters, batch
32, AdamW, 50 holdout examples). Every collection follows a real training step (collect_every_n=1); the
three configurations watch the same model, called in rotating order after each step, and the cost is the
hook's own telemetry_ms, median over the repeats after the first collection (which has no reference). Three
configurations: "core" (the core issue's sections only: no update ratio/drift, no system metrics, no
alerts), "default" (what a user gets: core + update ratio, drift, weight norm, system metrics, alerts) and
"comprehensive" (+ per-layer stats, parameter-change statistics, sparse quality at 3 thresholds).
"""

import argparse
import os
import statistics
import sys
import tempfile

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from telemetry import TelemetryConfig, TrainingTelemetry  # noqa: E402


def measure(configs, model, optimizer, batches, holdout, repeats):
    """Median telemetry_ms per configuration. All instances watch the same model and are called after the
    same training steps, in rotating order, so load on the machine hits every configuration alike."""
    costs = {name: [] for name in configs}
    with tempfile.TemporaryDirectory() as out:
        hooks = {}
        for name, make in configs.items():
            hooks[name] = TrainingTelemetry(make(output_dir=os.path.join(out, name), collect_every_n=1))
            hooks[name].set_holdout_data(holdout)
        names = list(configs)
        for i in range(repeats + 1):
            x, y = batches[i % len(batches)]
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            for name in names[i % len(names):] + names[:i % len(names)]:
                record = hooks[name].on_batch_end(model, optimizer, i, 0, batch=(x, y), loss=loss)
                assert "errors" not in record, record["errors"]
                if i:  # the first collection has no reference yet: it measures less
                    costs[name].append(record["telemetry_ms"])
            optimizer.zero_grad()
        for hook in hooks.values():
            hook.close()
    return costs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--width", type=int, default=4096)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    w = args.width
    model = nn.Sequential(nn.Linear(w, w), nn.ReLU(), nn.Linear(w, w), nn.ReLU(), nn.Linear(w, w), nn.ReLU(),
                          nn.Linear(w, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batches = [(torch.randn(32, w), torch.randint(0, 10, (32,))) for _ in range(4)]
    holdout = [(torch.randn(50, w), torch.randint(0, 10, (50,)))]
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params / 1e6:.1f}M parameters ({params * 4 / 2**20:.0f} MiB float32), "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.repeats} collections each")
    configs = {
        "core": lambda **kw: TelemetryConfig(track_update_ratio=False, track_system=False, alerts=False, **kw),
        "default": lambda **kw: TelemetryConfig(**kw),
        "comprehensive": lambda **kw: TelemetryConfig.comprehensive(**kw),
    }
    costs = measure(configs, model, optimizer, batches, holdout, args.repeats)
    med = {name: statistics.median(c) for name, c in costs.items()}
    for name, c in costs.items():
        print(f"{name:>14}: {med[name]:8.1f} ms per collection (min {min(c):.1f}, max {max(c):.1f})")
    print(f"default / core:          {med['default'] / med['core']:.2f}x  (update ratio + drift + system + alerts)")
    print(f"comprehensive / default: {med['comprehensive'] / med['default']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
