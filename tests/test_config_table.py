"""Every malformed config is refused with a message that names the field (or, for a YAML file, the file):
never accepted silently, never a bare TypeError from deep inside."""

import math
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from telemetry import TelemetryConfig  # noqa: E402

pytest.importorskip("yaml", reason="pyyaml reads the YAML cases")

# (config as a dict, a word the message must contain)
BAD_DICTS = [
    ({"enabled": "yes"}, "enabled"),
    ({"enabled": 1}, "enabled"),
    ({"collect_every_n": 0}, "collect_every_n"),
    ({"collect_every_n": -5}, "collect_every_n"),
    ({"collect_every_n": 2.5}, "collect_every_n"),
    ({"collect_every_n": True}, "collect_every_n"),
    ({"collect_every_n": "10"}, "collect_every_n"),
    ({"collect_every_n": None}, "collect_every_n"),
    ({"output_dir": ""}, "output_dir"),
    ({"output_dir": "   "}, "output_dir"),
    ({"output_dir": 5}, "output_dir"),
    ({"output_dir": ["runs"]}, "output_dir"),
    ({"output_dir": os.path.join(__file__, "run")}, "output_dir"),  # below a file
    ({"track_gradients": "true"}, "track_gradients"),
    ({"track_weight_delta": 0}, "track_weight_delta"),
    ({"track_holdout_logits": None}, "track_holdout_logits"),
    ({"holdout_size": -1}, "holdout_size"),
    ({"holdout_size": 1.5}, "holdout_size"),
    ({"holdout_size": "50"}, "holdout_size"),
    ({"groups": {"overall": ["head"]}}, "groups"),
    ({"groups": {"other": ["head"]}}, "groups"),
    ({"groups": {"not_in_optimizer": ["head"]}}, "groups"),
    ({"groups": {"lora_A": ["lora_A"]}}, "groups"),
    ({"groups": {"lora_B": ["x"]}}, "groups"),
    ({"groups": {"all": ["x"]}}, "groups"),
    ({"groups": {"head": []}}, "groups"),
    ({"groups": {"head": [""]}}, "groups"),
    ({"groups": {"": ["head"]}}, "groups"),
    ({"groups": {"head": [1]}}, "groups"),
    ({"groups": {"head": None}}, "groups"),
    ({"groups": ["head"]}, "groups"),
    ({"groups": "head"}, "groups"),
    ({"batch_label_key": ""}, "batch_label_key"),
    ({"batch_label_key": 3}, "batch_label_key"),
    ({"strict": "no"}, "strict"),
    ({"holdout_token_ids": [-1]}, "holdout_token_ids"),
    ({"holdout_token_ids": ["a"]}, "holdout_token_ids"),
    ({"holdout_token_ids": 5}, "holdout_token_ids"),
    ({"layer_stats_by": "module"}, "layer_stats_by"),
    ({"layer_stats_by": None}, "layer_stats_by"),
    ({"param_change_thresholds": [-1e-6]}, "param_change_thresholds"),
    ({"param_change_thresholds": [math.nan]}, "param_change_thresholds"),
    ({"param_change_thresholds": [math.inf]}, "param_change_thresholds"),
    ({"param_change_thresholds": 1e-6}, "param_change_thresholds"),
    ({"param_change_rel_thresholds": ["x"]}, "param_change_rel_thresholds"),
    ({"sparse_quality_thresholds": [-1.0]}, "sparse_quality_thresholds"),
    ({"alert_window": 4}, "alert_window"),
    ({"alert_window": 0}, "alert_window"),
    ({"alert_spike_threshold": 0}, "alert_spike_threshold"),
    ({"alert_spike_threshold": -3.0}, "alert_spike_threshold"),
    ({"alert_spike_threshold": math.nan}, "alert_spike_threshold"),
    ({"alert_spike_threshold": math.inf}, "alert_spike_threshold"),
    ({"alert_explosion_factor": 1.0}, "alert_explosion_factor"),
    ({"alert_explosion_factor": math.inf}, "alert_explosion_factor"),
    ({"alert_explosion_factor": math.nan}, "alert_explosion_factor"),
    ({"mirror": ["mlflow"]}, "mirror"),
    ({"mirror": "comet"}, "mirror"),
    ({"mirror": [1]}, "mirror"),
    ({"preset": "fast"}, "preset"),
    ({"preset": ["minimal"]}, "preset"),
    ({"preset": None}, "preset"),
    ({"collect_every_nn": 5}, "collect_every_nn"),
    ({"trackgradients": True}, "trackgradients"),
    ({5: True}, "5"),
]


@pytest.mark.parametrize("config,field", BAD_DICTS, ids=[f"{f}-{i}" for i, (_, f) in enumerate(BAD_DICTS)])
def test_a_bad_field_is_refused_naming_it(config, field):
    with pytest.raises(ValueError) as refused:
        TelemetryConfig.from_dict(config)
    assert field in str(refused.value)


# (YAML file contents, what else the message must say besides the file's path)
BAD_FILES = [
    (b"", "empty"),
    (b"# only a comment\n", "empty"),
    (b"- collect_every_n: 5\n", "mapping"),
    (b"42\n", "mapping"),
    (b"just text\n", "mapping"),
    (b"telemetry:\n  collect_every_n: 5\n  collect_every_n: 7\n", "twice"),
    (b"collect_every_n: 5\ncollect_every_n: 7\n", "twice"),
    (b"collect_every_n: \xff\n", "UTF-8"),
    (b"collect_every_n: [1, 2\n", "YAML"),
    (b"telemetry:\n  alert_spike_threshold: .nan\n", "alert_spike_threshold"),
    (b"telemetry:\n  alert_explosion_factor: .inf\n", "alert_explosion_factor"),
    (b"telemetry:\n  preset: [minimal]\n", "preset"),
    (b"telemetry:\n  output_dir: ''\n", "output_dir"),
    (b"telemetry:\n  groups: {overall: [head]}\n", "groups"),
    (b"telemetry:\n  groups: {head: []}\n", "groups"),
    (b"telemetry:\n  colect_every_n: 5\n", "colect_every_n"),
    (b"!!python/object/apply:os.system ['true']\n", "YAML"),
]


@pytest.mark.parametrize("text,said", BAD_FILES, ids=[f"{s}-{i}" for i, (_, s) in enumerate(BAD_FILES)])
def test_a_bad_yaml_file_is_refused_naming_the_file(tmp_path, text, said):
    path = tmp_path / "telemetry.yaml"
    path.write_bytes(text)
    with pytest.raises(ValueError) as refused:
        TelemetryConfig.from_yaml(path)
    assert str(path) in str(refused.value) and said in str(refused.value)


def test_a_yaml_section_inside_a_larger_config_is_read():
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write("model: {hidden: 64}\ntelemetry:\n  collect_every_n: 7\n")
    try:
        assert TelemetryConfig.from_yaml(f.name).collect_every_n == 7
    finally:
        os.remove(f.name)


def test_the_table_is_long_enough():
    assert len(BAD_DICTS) + len(BAD_FILES) >= 60
