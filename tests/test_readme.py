"""The README against the program: its findings table is the analyzer's list, its example outputs are what
the demo prints (tests/readme_examples.py regenerates them), every code the program emits is listed, its
quick start runs on real data as written, and the tests it names as guarantees exist."""
import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import analyze_telemetry
import readme_examples

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def test_findings_table_is_the_analyzers_list():
    assert readme_examples.differences(README, {"findings": readme_examples.findings_table()}) == []


def _literal_severities(node) -> set:
    return {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def test_every_code_the_program_emits_is_listed_with_its_severities():
    """Every Finding(...) of the analyzer and every alert telemetry.py yields, read from the source: its code
    is in FINDINGS, with each severity it can take and the right source."""
    source = (ROOT / "analyze_telemetry.py").read_text(encoding="utf-8")
    seen = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Finding":
            code = node.args[0]
            if isinstance(code, ast.Name) and code.id == "code":
                continue   # check_telemetry_alerts: telemetry.py's codes, checked below
            value = code.value if isinstance(code, ast.Constant) else getattr(analyze_telemetry, code.id)
            seen.append((value, _literal_severities(node.args[1]), "analyzer"))
    tree = ast.parse((ROOT / "telemetry.py").read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Yield) and isinstance(node.value, ast.Tuple)):
            continue
        items = node.value.elts
        if len(items) == 4 and all(isinstance(i, ast.Constant) for i in items[:2]) \
                and items[1].value in analyze_telemetry.SEVERITIES:
            seen.append((items[0].value, {items[1].value}, "telemetry"))
    assert len([s for s in seen if s[2] == "telemetry"]) >= 6 and len(seen) >= 30
    for code, severities, source in seen:
        assert code in analyze_telemetry.FINDINGS, code
        listed, from_, _ = analyze_telemetry.FINDINGS[code]
        assert severities <= set(listed), (code, severities, listed)
        assert from_ in (source, "both"), (code, source, from_)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    scratch = tmp_path_factory.mktemp("demo")
    readme_examples.train_demo(scratch)
    return scratch


def test_readme_examples_are_what_the_demo_prints(demo):
    stale = readme_examples.differences(README, readme_examples.parts(demo))
    assert not stale, f"regenerate with: python tests/readme_examples.py ({stale} differ)"


def test_demo_healthy_is_quiet_and_overfit_is_called_out(demo):
    healthy = readme_examples.analyze(demo, "healthy", "--json", "--check")
    report = json.loads(healthy.stdout)
    assert healthy.returncode == 0 and not [f for f in report["findings"] if f["severity"] != "info"]
    assert not [n for n in report["notices"] if "analysis check failed" in n], report["notices"]
    assert report["summary"]["holdout_acc_last"] > 0.7
    overfit = readme_examples.analyze(demo, "overfit", "--json", "--check")
    found = {f["code"]: f["severity"] for f in json.loads(overfit.stdout)["findings"]}
    assert overfit.returncode == 1 and found.get("holdout_at_chance") == "critical", found


# ---- the quick start, as written, on scikit-learn's digits ----

class Digits(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, pixels):
        return self.net(pixels)


class DictDataset(torch.utils.data.Dataset):
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {"pixels": self.x[i], "label": self.y[i]}


def quick_start_code() -> str:
    start = README.index("## Quick start")
    return re.search(r"```python\n(.*?)```", README[start:], re.S).group(1)


@pytest.mark.parametrize("kind", ["tuple", "dict"])
def test_quick_start_runs_on_digits_and_the_run_is_quiet(kind, tmp_path, monkeypatch):
    """The README's quick-start code, unchanged, in a loop on digits with (x, y) or dict batches: no warning
    while training, and the analyzer finds nothing at all. Healthy is checked on the rest of digits, which
    the holdout never saw."""
    from sklearn.datasets import load_digits
    x, y = load_digits(return_X_y=True)
    x, y = torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y)
    gen = torch.Generator().manual_seed(0)
    order = torch.randperm(len(y), generator=gen)
    train, val, test = order[:1200], order[1200:1400], order[1400:]
    torch.manual_seed(0)
    model = Digits()
    if kind == "tuple":
        make = lambda idx: torch.utils.data.TensorDataset(x[idx], y[idx])  # noqa: E731
        compute_loss = lambda m, b: F.cross_entropy(m(b[0]), b[1])  # noqa: E731
    else:
        make = lambda idx: DictDataset(x[idx], y[idx])  # noqa: E731
        compute_loss = lambda m, b: F.cross_entropy(m(pixels=b["pixels"]), b["label"])  # noqa: E731
    namespace = dict(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=3e-3), epochs=8,
                     train_loader=torch.utils.data.DataLoader(make(train), batch_size=32, shuffle=True,
                                                              generator=gen),
                     val_loader=torch.utils.data.DataLoader(make(val), batch_size=32), compute_loss=compute_loss)
    monkeypatch.chdir(tmp_path)
    with _no_warnings():
        exec(compile(quick_start_code(), "README.md", "exec"), namespace)
    with torch.no_grad():
        accuracy = (model(x[test]).argmax(1) == y[test]).float().mean().item()
    assert accuracy > 0.9   # healthy, on 397 examples the holdout never saw
    done = subprocess.run([sys.executable, str(ROOT / "analyze_telemetry.py"), "runs/exp1", "--json", "--check"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    report = json.loads(done.stdout)
    found = [(f["code"], f["severity"], f["message"]) for f in report["findings"]]
    assert done.returncode == 0 and not found, found
    assert report["summary"]["records"] >= 20


class _no_warnings:
    def __enter__(self):
        import warnings
        self.catcher = warnings.catch_warnings(record=True)
        self.caught = self.catcher.__enter__()
        warnings.simplefilter("always")

    def __exit__(self, *exc):
        self.catcher.__exit__(*exc)
        mine = [str(w.message) for w in self.caught if "telemetry" in str(w.message) or "telemetry" in w.filename]
        assert not mine, mine


# ---- what the README says about the project ----

def test_the_guarantees_name_tests_that_exist():
    start = README.index("## Guarantees")
    section = README[start:README.index("\n## ", start + 1)]
    named = set(re.findall(r"`(test_\w+)`", section))
    files = set(re.findall(r"`(tests/test_\w+\.py)`", section))
    assert len(named) >= 8 and files
    sources = "".join(p.read_text(encoding="utf-8") for p in (ROOT / "tests").glob("test_*.py"))
    for name in named:
        assert re.search(rf"def {name}\b", sources), name
    for f in files:
        assert (ROOT / f).exists(), f


def test_no_machine_paths_or_project_history():
    texts = {p.name: p.read_text(encoding="utf-8") for p in [ROOT / "README.md", ROOT / "bench" / "README.md",
                                                              ROOT / "telemetry.py", ROOT / "analyze_telemetry.py",
                                                              ROOT / "example_train.py"]}
    for name, text in texts.items():
        for pattern in (r"/work/", r"/home/\w+", r"/[a-z]+/[a-z]*venv/bin", r"this session", r"the seed",
                        r"\bseed \d{3}\b"):
            assert not re.search(pattern, text, re.I), (name, pattern)


def test_the_performance_table_quotes_bench_results_with_commands_that_exist():
    """Every figure in the README's Performance table is one of bench/RESULTS.md's (rounded as quoted), and
    every command runs a script that bench/ holds: the README quotes no figure without its command."""
    start = README.index("## Performance")
    end = README.find("\n## ", start + 1)
    rows = [line.strip("| ").split(" | ") for line in README[start:end if end > 0 else None].splitlines()
            if line.startswith("| ") and not line.startswith("| Workload") and "---" not in line]
    assert len(rows) >= 5
    results = (ROOT / "bench" / "RESULTS.md").read_text(encoding="utf-8").replace(",", "")
    measured = [float(x) for x in re.findall(r"\d+(?:\.\d+)?", results)]
    for row in rows:
        figure, command = row[2], row[3]
        for quoted in re.findall(r"\d+(?:\.\d+)?", figure.replace(",", "")):
            places = len(quoted.partition(".")[2])
            assert any(round(y, places) == float(quoted) for y in measured), (quoted, row)
        scripts = re.findall(r"bench/\w+\.py", command)
        assert scripts or command.strip() == "same", row
        for script in scripts:
            assert (ROOT / script).exists(), script
