"""The report and plots a person opens: a real 10-class run with three optimizer groups (one of them empty:
an lr, no trainable tensors), made here with telemetry.py and analyzed once, then read as HTML, as figures and
as a screenshot from headless Chromium."""

import contextlib
import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import analyze_telemetry as at  # noqa: E402

PY = sys.executable
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def train_ten_classes(out, steps=96):
    """A 10-class MLP whose batches over-represent class 0, with groups body and head at the same cosine-
    scheduled lr and group 'unused' holding only a frozen tensor (run.json: tensors 0)."""
    from telemetry import TelemetryConfig, TrainingTelemetry

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    model.register_parameter("frozen", torch.nn.Parameter(torch.zeros(3), requires_grad=False))
    optimizer = torch.optim.Adam([{"params": model[0].parameters(), "lr": 1e-2, "name": "body"},
                                  {"params": model[2].parameters(), "lr": 1e-2, "name": "head"},
                                  {"params": [model.frozen], "lr": 1e-3, "name": "unused"}])
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
    w = torch.randn(16, 10)
    x_val = torch.randn(50, 16)
    telemetry = TrainingTelemetry(TelemetryConfig(output_dir=str(out), collect_every_n=3, track_layer_stats=True))
    telemetry.set_holdout_data((x_val, (x_val @ w).argmax(1)))
    for step in range(steps):
        x = torch.randn(32, 16)
        y = torch.where(torch.rand(32) < 0.3, 0, (x @ w).argmax(1))
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        telemetry.on_batch_end(model, optimizer, step, 0, batch=(x, y), loss=loss)
    telemetry.close()
    return out


@pytest.fixture(scope="module")
def ten(tmp_path_factory):
    """(run directory, analysis directory, what the default command printed), analyzed once."""
    run = train_ten_classes(tmp_path_factory.mktemp("runs") / "ten")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert at.main([str(run)]) == 0
    return run, run / "analysis", printed.getvalue()


def figure_of(plot, run, monkeypatch):
    """The matplotlib figure a plot function draws, before it is saved."""
    figures = []
    monkeypatch.setattr(at, "_save", lambda fig, path, title: figures.append(fig))
    assert plot([at.load_run(run, progress=False)], Path("unused.png")) is None
    return figures[0]


def test_report_shows_the_run_its_groups_and_how_to_read_each_plot(ten):
    run, out, stdout = ten
    html = (out / "report.html").read_text()
    assert "http-equiv='refresh'" not in html   # only while --watch runs
    assert "<h2>Run: ten</h2>" in html and "<h3>Groups</h3>" in html
    config = json.loads((run / "run.json").read_text())["config"]
    assert f"config ({len(config)} keys, from run.json)" in html and "track_layer_stats: true" in html
    assert "<td>unused</td><td>0</td><td>0</td>" in html and "empty: 1 frozen tensor" in html
    written = sorted(p.name for p in out.glob("*.png"))
    assert html.count("data:image/png;base64,") == len(written) == 10
    for name in written:
        assert f"<b>{name}</b>: {at.PLOT_HELP[name]}" in html.replace("&#x27;", "'")
    skipped = [line for line in stdout.splitlines() if line.startswith("skipped")]
    assert skipped == ["skipped 3 plots: lora (a model with LoRA adapters), param_change_sparsity "
                       "(track_param_change: true), sparse_quality (track_sparse_quality: true)"]


def test_ten_classes_are_a_heatmap_and_every_group_shows_its_learning_rate(ten, monkeypatch):
    run, _, _ = ten
    balance = figure_of(at.plot_batch_balance, run, monkeypatch)
    assert balance.axes[0].images and not balance.axes[0].lines   # one heatmap, not ten lines
    lr = figure_of(at.plot_learning_rate, run, monkeypatch).axes[0]
    labels = [line.get_label() for line in lr.lines]
    assert labels == ["body", "head", "unused (empty: 1 frozen tensor)", "overall"]
    body, head, _, overall = lr.lines
    assert list(body.get_ydata()) == list(head.get_ydata())   # equal rates: markers at different steps
    assert body.get_markevery()[0] != head.get_markevery()[0] and body.get_marker() != head.get_marker()
    assert overall.get_linestyle() == "--" and overall.get_zorder() > head.get_zorder()   # on top, dashed


def test_system_panels_span_at_least_a_tenth_of_their_values(ten, monkeypatch):
    run, _, _ = ten
    axes = {ax.get_title(): ax for ax in figure_of(at.plot_system, run, monkeypatch).axes}
    rss = at.column(at.load_run(run, progress=False), "system.rss_mb")
    low, high = axes["rss_mb"].get_ylim()
    assert high - low >= 0.1 * max(rss) and low <= min(rss) and high >= max(rss)


def test_unchanged_plots_are_not_rewritten(ten):
    run, out, _ = ten
    before = {p.name: p.stat().st_mtime_ns for p in out.glob("*.png")}
    written, _ = at.make_plots([at.load_run(run, progress=False)], out)   # the same records again
    assert {p.name: p.stat().st_mtime_ns for p in written} == before
    assert not at.write_if_changed(written[0], written[0].read_bytes())


def test_a_comparison_goes_to_a_directory_named_after_every_run(ten, tmp_path, capsys, monkeypatch):
    run, _, _ = ten
    other = tmp_path / "other"
    shutil.copytree(run, other, ignore=shutil.ignore_patterns("analysis"))
    monkeypatch.setattr(at, "make_plots", lambda runs, out: (out.mkdir(parents=True, exist_ok=True), ([], []))[1])
    assert at.main([str(run), str(other)]) == 0
    out = run / "analysis" / "compare-ten-vs-other"
    assert (out / "report.html").is_file() and str(out / "report.html") in capsys.readouterr().out
    assert "<th>ten</th><th>other</th>" in (out / "report.html").read_text()
    names = [at.new_run(f"/x/{'r' * 40}{i}") for i in range(4)]
    assert len(at.comparison_name(names)) <= 100   # many runs: shortened, with a digest of all names


@pytest.mark.parametrize("missing, line", [
    ("numpy", "analyze_telemetry needs numpy: pip install numpy matplotlib"),
    ("matplotlib", "plots skipped: matplotlib is not installed (pip install numpy matplotlib)")])
def test_a_missing_package_is_one_line_naming_the_install(ten, tmp_path, missing, line):
    run, _, _ = ten
    copy = tmp_path / "run"
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("analysis"))
    code = (f"import sys; sys.modules[{missing!r}] = None; sys.path.insert(0, {str(ROOT)!r}); "
            f"import analyze_telemetry as a; sys.exit(a.main([{str(copy)!r}]))")
    proc = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.stderr.splitlines() == [line] and "Traceback" not in proc.stderr
    assert proc.returncode == (2 if missing == "numpy" else 0)
    assert not (copy / "analysis").exists()   # no empty analysis folder
    if missing == "matplotlib":
        assert "Run run (" in proc.stdout   # the diagnosis still comes


@pytest.mark.skipif(shutil.which("chromium") is None, reason="chromium is not installed (apt-get install chromium)")
def test_report_renders_in_headless_chromium(ten, tmp_path):
    """At 1600 px the plots fill the width in two columns, beside the run's tables at the top."""
    _, out, _ = ten
    shot = tmp_path / "shot.png"
    cmd = ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
           "--disable-quic", "--no-first-run", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={shot}", "--window-size=1600,2400",
           (out / "report.html").resolve().as_uri()]
    subprocess.run(cmd, capture_output=True, timeout=90)
    assert shot.is_file() and shot.read_bytes()[:8] == PNG_SIGNATURE
    import matplotlib.image as mpimg
    ink = mpimg.imread(str(shot))[..., :3].mean(axis=2) < 0.95
    height, width = ink.shape
    assert ink.mean() > 0.05, ink.mean()
    # The old one-column page left everything right of 1150 px blank: now the run's tables stand there at
    # the top, and the second column of plots below.
    right = ink[:, int(0.75 * width): int(0.97 * width)]
    assert right[: height // 4].mean() > 0.01 and right[height // 2:].mean() > 0.05, (right[: height // 4].mean(),
                                                                                        right[height // 2:].mean())
