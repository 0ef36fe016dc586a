"""The analyzer's verdicts on real runs of example_train.py (short versions of its scenarios).

healthy must give no warning or critical finding; overfit (16 training pairs, memorised) must be called
out as overfitting and/or holdout at chance, and fail --check.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable

pytestmark = pytest.mark.skipif(not (ROOT / "example_train.py").exists(), reason="example_train.py is not there yet")


def train_and_analyze(tmp_path, scenario, *flags):
    out = tmp_path / scenario
    train = subprocess.run([PY, str(ROOT / "example_train.py"), "--scenario", scenario, "--out", str(out), *flags],
                           cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert train.returncode == 0, train.stderr[-2000:]
    analyze = subprocess.run([PY, str(ROOT / "analyze_telemetry.py"), str(out), "--json", "--check"],
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
    report = json.loads(analyze.stdout)
    assert not [n for n in report["notices"] if "analysis check failed" in n], report["notices"]
    return analyze.returncode, report


def test_healthy_example_has_no_warnings(tmp_path):
    rc, report = train_and_analyze(tmp_path, "healthy", "--epochs", "2")
    bad = [(f["code"], f["message"]) for f in report["findings"] if f["severity"] != "info"]
    assert not bad and rc == 0, bad
    assert report["summary"]["holdout_acc_last"] > 0.7


def test_overfit_example_is_called_out(tmp_path):
    rc, report = train_and_analyze(tmp_path, "overfit", "--epochs", "60")
    found = {f["code"]: f["severity"] for f in report["findings"]}
    assert {"overfitting", "holdout_at_chance"} & set(found), found
    assert rc == 1 and found.get("holdout_at_chance") == "critical"
