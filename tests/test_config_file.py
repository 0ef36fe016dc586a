"""The config file a project gets without the repository: `python telemetry.py --write-config PATH` writes
the documented defaults with torch alone, and the shipped telemetry.yaml is exactly that file."""

import dataclasses
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import telemetry  # noqa: E402
from telemetry import CONFIG_FILE_OVERRIDES, TelemetryConfig, default_config_yaml, yaml_value  # noqa: E402

yaml = pytest.importorskip("yaml")


def test_shipped_file_is_what_write_config_writes():
    with open(os.path.join(ROOT, "telemetry.yaml"), encoding="utf-8") as f:
        assert f.read() == default_config_yaml(), "regenerate: python telemetry.py --write-config telemetry.yaml --force"


def test_written_file_loads_to_the_defaults_but_the_documented_overrides(tmp_path):
    path = tmp_path / "telemetry.yaml"
    path.write_text(default_config_yaml(), encoding="utf-8")
    loaded, defaults = TelemetryConfig.from_yaml(str(path)), TelemetryConfig()
    differ = {f.name for f in dataclasses.fields(TelemetryConfig) if getattr(loaded, f.name) != getattr(defaults, f.name)}
    assert differ == set(CONFIG_FILE_OVERRIDES) == {"collect_every_n"}
    assert loaded == TelemetryConfig(**CONFIG_FILE_OVERRIDES)
    # The one deliberate difference is explained where a reader meets it.
    line = next(i for i, l in enumerate(default_config_yaml().splitlines()) if l.strip().startswith("collect_every_n:"))
    assert "200" in default_config_yaml().splitlines()[line + 1]


def test_every_field_is_documented_once():
    keys = [entry[0] for entry in telemetry._CONFIG_DOC if not isinstance(entry, str)]
    assert sorted(keys) == sorted(f.name for f in dataclasses.fields(TelemetryConfig))
    assert all(why for entry in telemetry._CONFIG_DOC if not isinstance(entry, str) for why in entry[1:])


def test_write_config_needs_only_torch_and_keeps_an_existing_file(tmp_path):
    shutil.copy(os.path.join(ROOT, "telemetry.py"), tmp_path)   # a project that copied the module alone
    no_yaml = ("import runpy, sys; sys.modules['yaml'] = None; sys.argv = ['telemetry.py'] + sys.argv[1:]; "
               "runpy.run_path('telemetry.py', run_name='__main__')")

    def write(*args):
        return subprocess.run([sys.executable, "-c", no_yaml, "--write-config", "telemetry.yaml", *args],
                              cwd=tmp_path, capture_output=True, text=True, timeout=120)

    first = write()
    assert first.returncode == 0, first.stderr
    assert (tmp_path / "telemetry.yaml").read_text(encoding="utf-8") == default_config_yaml()
    (tmp_path / "telemetry.yaml").write_text("telemetry: {collect_every_n: 3}\n")
    again = write()
    assert again.returncode == 1 and "--force" in again.stderr and "Traceback" not in again.stderr
    assert (tmp_path / "telemetry.yaml").read_text() == "telemetry: {collect_every_n: 3}\n"
    assert write("--force").returncode == 0
    assert (tmp_path / "telemetry.yaml").read_text(encoding="utf-8") == default_config_yaml()


@pytest.mark.parametrize("value", [None, True, False, 0, 200, 8.0, 1e-8, 1e-4, 0.001, -3e-5, 1e20, 0.1,
                                   "layer", "yes", "Off", "a b", "x:y", "", "1abc",
                                   [1e-8, 1e-3], {"backbone": ["backbone.*"], "head": ["head", "x y"]}])
def test_values_read_back_as_written(value):
    assert yaml.safe_load(f"k: {yaml_value(value)}")["k"] == value
