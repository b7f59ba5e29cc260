"""Numbers and files checked at start-up: ranges, machine bounds, duplicate keys, a second --config, null data."""

from __future__ import annotations

import json

import pytest

from miles.config import FIELDS, NUMBER_RANGES, ConfigError, DataConfig, in_range, load_config
from miles.rollout.data_source import JsonlDataSource
from miles.rollout.prompt_rows import DataRowError


def test_every_numeric_flag_states_a_range_its_default_lies_in():
    numeric = {
        name
        for name, spec in FIELDS.items()
        if spec.base in (int, float) or (spec.base is list and spec.elem in (int, float))
    }
    assert numeric - NUMBER_RANGES.keys() == set(), "numeric fields without option(range=...)"
    assert NUMBER_RANGES.keys() - numeric == set(), "ranges of fields that are not numeric (renamed?)"
    for name in numeric:
        default = FIELDS[name].default
        for value in default if isinstance(default, list) else [default]:
            assert value is None or in_range(value, NUMBER_RANGES[name][0]), (name, value)


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--save-interval", "0"], "--save-interval=0 is outside [1, inf)"),
        (["--eval-interval", "-1"], "--eval-interval=-1 is outside [0, inf)"),
        (["--heartbeat-interval-s", "0"], "--heartbeat-interval-s=0.0 is outside (0, 3600]"),
        (["--n-samples-per-prompt", "0"], "config error: --n-samples-per-prompt=0 must be a positive integer"),
        (["--update-weights-interval", "0"], "--update-weights-interval=0 is outside"),
        (["--micro-batch-size", "-2"], "--micro-batch-size=-2 is outside"),
        (["--profile-steps", "3", "-1"], "--profile-steps=-1 is outside [0, inf)"),
        (["--rollout-top-k", "0"], "--rollout-top-k=0 is outside -1 or [1, inf)"),
        (["--rollout-batch-size", "100000", "--n-samples-per-prompt", "1000"], "samples per rollout step"),
        (["--update-weight-buffer-size", str(2**62)], "more than this host's"),
        (["--http-max-body-mb", "1e12"], "more than this host's"),
    ],
)
def test_a_number_outside_its_range_is_refused_at_start_up(argv, needle):
    with pytest.raises(ConfigError) as err:
        load_config(argv, for_train=False)
    assert needle in str(err.value)


def test_a_duplicate_yaml_key_is_refused_naming_the_key_and_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("lr: 1.0e-6\nrollout-batch-size: 4\nlr: 2.0e-6\n")
    with pytest.raises(ConfigError, match=r"run.yaml: key 'lr' appears twice \(lines 1 and 3\)"):
        load_config(["--config", str(path)], for_train=False)


def test_one_field_set_by_two_yaml_spellings_is_refused(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("rollout-batch-size: 8\nrollout:\n  rollout_batch_size: 4\n")
    with pytest.raises(ConfigError, match="sets rollout_batch_size again"):
        load_config(["--config", str(path)], for_train=False)


def test_a_second_config_is_refused(tmp_path):
    first, second = tmp_path / "a.yaml", tmp_path / "b.yaml"
    first.write_text("lr: 1.0e-6\n")
    second.write_text("lr: 2.0e-6\n")
    with pytest.raises(ConfigError, match="--config given 2 times"):
        load_config(["--config", str(first), "--config", str(second)], for_train=False)


@pytest.mark.parametrize(
    ("row", "needle"),
    [
        ({"input": "2+2?", "label": None}, "label 'label' is null"),
        ({"input": "2+2?", "label": "4", "metadata": None}, "'metadata' is null"),
        ({"input": [{"role": "user", "content": None}], "label": "4"}, "content is null"),
        ({"input": [{"role": None, "content": "hi"}], "label": "4"}, "role is None"),
    ],
)
def test_a_null_dataset_field_is_refused_with_file_and_line(tmp_path, row, needle):
    path = tmp_path / "prompts.jsonl"
    good = {"input": "1+1?", "label": "2"}
    path.write_text(json.dumps(good) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(DataRowError) as err:
        JsonlDataSource(DataConfig(prompt_data=str(path), label_key="label"), n_samples_per_prompt=1)
    assert f"{path}:2:" in str(err.value) and needle in str(err.value)
