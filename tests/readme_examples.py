"""The README's generated parts: the findings table (from analyze_telemetry.FINDINGS) and the example
outputs (what `make demo` prints, run here in a scratch directory).

    python tests/readme_examples.py          # rewrite them in README.md
    python tests/readme_examples.py --check  # exit 1 and say which part differs

Each part sits between `<!-- generated: NAME -->` and `<!-- end: NAME -->`; tests/test_readme.py checks that
the README holds what this script writes. Timings are masked: they differ from run to run.
"""
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
sys.path.insert(0, str(ROOT))

import analyze_telemetry  # noqa: E402

DEMO = ("healthy", "overfit")   # the scenarios `make demo` trains and analyzes, in its order
BLOCK = re.compile(r"(<!-- generated: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- end: (?P=name) -->)", re.S)
# "150 epoch(s), 5s" and "in 0.3 s": the run's wall time and the analyzer's own
TIMING = re.compile(r"\b\d+(\.\d+)?\s?(ms|s|min|h)\b")


def findings_table() -> str:
    stage_of = {code: i for i, stage in enumerate(analyze_telemetry.STAGES) for code in stage}
    codes = sorted(analyze_telemetry.FINDINGS, key=lambda c: stage_of.get(c, len(analyze_telemetry.STAGES)))
    names = ["set-up", "data", "blow-ups", "the model's units", "loss and holdout", "telemetry's own alerts"]
    rows = ["| stage | code | severity | from | what it means |", "|---|---|---|---|---|"]
    for code in codes:
        severities, source, meaning = analyze_telemetry.FINDINGS[code]
        stage = names[stage_of.get(code, len(analyze_telemetry.STAGES))]
        if code == "metric_errors":
            stage = "bookkeeping"
        rows.append(f"| {stage} | `{code}` | {', '.join(severities)} | {source} | {meaning} |")
    return "\n".join(rows) + "\n"


def mask(text: str) -> str:
    return TIMING.sub("<time>", text)


ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONHASHSEED="0")


def train_demo(scratch) -> None:
    """The runs `make demo` trains, under scratch/runs/: one thread, the example's defaults."""
    for scenario in DEMO:
        subprocess.run([sys.executable, str(ROOT / "example_train.py"), "--scenario", scenario,
                        "--out", f"runs/{scenario}"], cwd=scratch, env=ENV, check=True, capture_output=True,
                       timeout=600)


def analyze(scratch, scenario: str, *flags) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "analyze_telemetry.py"), f"runs/{scenario}", *flags],
                          cwd=scratch, env=ENV, capture_output=True, text=True, timeout=300)


def demo_outputs(scratch) -> dict:
    """{scenario: what `make demo` prints for it}, from the runs train_demo left in scratch."""
    return {scenario: f"$ python analyze_telemetry.py runs/{scenario}\n" + analyze(scratch, scenario).stdout
            for scenario in DEMO}


RECORD_STEP = 30   # a collection of the healthy demo run with every default section
VARIES = {"timestamp": "...", "telemetry_ms": "...", "system": "..."}   # wall-clock values: masked


def _short(value):
    """Lists cut to their first two items, then "...". Floats to 4 significant digits: the record's values are
    float32 sums, whose last bits differ between processors (their vector kernels add in another order)."""
    if isinstance(value, list):
        return [_short(v) for v in value[:2]] + (["..."] if len(value) > 2 else [])
    if isinstance(value, dict):
        return {k: _short(v) for k, v in value.items()}
    return float(f"{value:.4g}") if isinstance(value, float) else value


def record_example(scratch) -> str:
    """One record of the healthy demo run, one top-level key per line, lists shortened."""
    with open(Path(scratch) / "runs" / "healthy" / "telemetry.jsonl", encoding="utf-8") as f:
        record = next(r for r in map(json.loads, f) if r["step"] == RECORD_STEP)
    lines = [f"{json.dumps(k)}: {json.dumps(VARIES.get(k, _short(v)), separators=(',', ':'))}"
             for k, v in record.items()]
    return "```\n{" + ",\n ".join(lines) + "}\n```\n"


def parts(scratch) -> dict:
    """{name: the text between its markers}, from the demo's runs in scratch."""
    generated = {"findings": findings_table(), "record": record_example(scratch)}
    for scenario, text in demo_outputs(scratch).items():
        generated[f"demo-{scenario}"] = "```\n" + text.rstrip("\n") + "\n```\n"
    return generated


def differences(readme: str, generated: dict) -> list:
    """The names of the parts whose README text differs from the generated one (timings masked), and of
    the parts the README lacks."""
    found = {m["name"]: m["body"] for m in BLOCK.finditer(readme)}
    return [name for name, body in generated.items()
            if name not in found or mask(found[name]) != mask(body)]


def rewrite(readme: str, generated: dict) -> str:
    return BLOCK.sub(lambda m: m.group(1) + generated.get(m["name"], m["body"]) + m.group(4), readme)


def main(argv) -> int:
    with tempfile.TemporaryDirectory() as scratch:
        train_demo(scratch)
        generated = parts(scratch)
    readme = README.read_text(encoding="utf-8")
    if "--check" in argv:
        stale = differences(readme, generated)
        for name in stale:
            print(f"README.md: the part '{name}' differs from what tests/readme_examples.py generates")
        return 1 if stale else 0
    README.write_text(rewrite(readme, generated), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
