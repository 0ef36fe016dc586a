"""How long analyze_telemetry takes to load and diagnose a 100,000-record run (target: under 10 s).

    .venv/bin/python bench/analyze_speed.py [--records N]

Writes a synthetic run (schema 1, every record with gradient norms, weight deltas, learning rates,
a 50-example holdout with logits, and batch stats) to a temporary directory, then times
load_run + diagnose (+ summarize) the way the CLI runs them. Plots are not timed.
"""

import argparse
import json
import math
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import analyze_telemetry as at  # noqa: E402


def write_run(run_dir: Path, n: int, holdout: int = 50) -> int:
    rng = random.Random(0)
    labels = [rng.randint(0, 1) for _ in range(holdout)]
    difficulty = [rng.random() for _ in range(holdout)]
    (run_dir / "run.json").write_text(json.dumps({"schema": 1, "holdout": {"examples": holdout},
                                                  "parameters": {"total": 41410, "trainable": 41410}}))
    with open(run_dir / "telemetry.jsonl", "w") as f:
        for i in range(n):
            t = i / n
            skill = 0.5 + 0.45 * (1 - math.exp(-5 * t))
            margins = [4 * (skill - d + rng.gauss(0, 0.05)) for d in difficulty]
            # telemetry.py writes 9 significant digits; so does this
            logits = [[0.0, float(f"{m:.9g}")] if y == 1 else [float(f"{m:.9g}"), 0.0] for m, y in zip(margins, labels)]
            preds = [y if m > 0 else 1 - y for m, y in zip(margins, labels)]
            c1 = sum(rng.random() < 0.5 for _ in range(32))
            bb, hh = rng.uniform(0.7, 1.3), 3 * rng.uniform(0.7, 1.3)
            rec = {"schema": 1, "step": (i + 1) * 10, "batch_idx": (i * 10) % 1000 + 10, "epoch": i // 100,
                   "timestamp": f"2026-11-22T02:{(i // 60) % 60:02d}:{i % 60:02d}.000000",
                   "loss": round((0.1 + 0.6 * math.exp(-4 * t)) * math.exp(rng.gauss(0, 0.15)), 6),
                   "train_acc": round(min(1.0, skill + rng.gauss(0, 0.04)), 4),
                   "gradient_norm": {"overall": math.hypot(bb, hh), "backbone": bb, "head": hh},
                   "weight_delta": ({"overall": None, "backbone": None, "head": None} if i == 0 else
                                    {"overall": 0.05 * (1 - 0.5 * t), "backbone": 0.03, "head": 0.04}),
                   "learning_rates": {"overall": 1e-2, "backbone": 1e-3, "head": 1e-2},
                   "holdout_logits": {"kind": "classification", "logits": logits, "labels": labels,
                                      "predictions": preds, "accuracy": sum(p == y for p, y in zip(preds, labels)) / holdout,
                                      "loss": 0.5, "num_classes": 2},
                   "batch_stats": {"batch_size": 32, "label_key": "winner", "counts": {"0": 32 - c1, "1": c1},
                                   "winner_0_pct": 100 * (32 - c1) / 32, "winner_1_pct": 100 * c1 / 32},
                   "telemetry_ms": 3.1}
            f.write(json.dumps(rec, separators=(",", ":")) + "\n")
    return (run_dir / "telemetry.jsonl").stat().st_size


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--records", type=int, default=100_000)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        size = write_run(Path(tmp), args.records)
        print(f"wrote {args.records:,} records ({size / 1e6:.0f} MB) in {time.perf_counter() - t0:.1f}s")
        t0, c0 = time.perf_counter(), time.process_time()
        run = at.load_run(tmp)
        t1 = time.perf_counter()
        findings = at.diagnose(run)
        at.summarize(run, findings)
        t2, c2 = time.perf_counter(), time.process_time()
    print(f"load {t1 - t0:.2f}s + diagnose {t2 - t1:.2f}s = {t2 - t0:.2f}s wall ({c2 - c0:.2f}s CPU) for "
          f"{len(run.records):,} records ({len(findings)} findings: {', '.join(f.code for f in findings) or 'none'})")
    print("OK: under 10 s" if t2 - t0 < 10 else "SLOW: over the 10 s target")


if __name__ == "__main__":
    main()
