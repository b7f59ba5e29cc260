"""The memory flags: accepted where they work, refused by name (one line each) where they cannot."""

from __future__ import annotations

import pytest

from miles.config import ConfigError, load_config

BASE = {"hf_checkpoint": "m", "prompt_data": "p.jsonl", "rm_type": "math", "rollout_batch_size": 2, "num_rollout": 1}


def _errors(argv: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(argv, base=BASE, for_train=False)
    return str(info.value)


@pytest.mark.parametrize(
    "argv",
    [
        ["--optimizer-cpu-offload"],
        ["--offload-optimizer-states"],
        ["--stream-optimizer-state-to-disk", "--offload-train-disk-dir", "/tmp/x"],
        ["--stream-optimizer-state-to-disk", "--offload-train-disk-dir", "/tmp/x", "--stream-optimizer-state-moment-dtype", "bf16"],
        ["--offload-train-target", "disk", "--offload-train-disk-dir", "/tmp/x", "--colocate"],
        ["--no-async-save"],
        ["--async-save"],
    ],
)  # fmt: skip
def test_accepted_on_one_fsdp_rank(argv):
    cfg = load_config(argv, base=BASE, for_train=False)
    assert cfg.train.train_backend == "fsdp"


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--optimizer-cpu-offload", "--train-backend", "megatron"], ["--optimizer-cpu-offload", "--train-backend fsdp"]),
        (["--offload-optimizer-states", "--actor-num-gpus-per-node", "2"], ["--offload-optimizer-states", "one trainer rank"]),
        (["--optimizer-cpu-offload", "--offload-optimizer-states"], ["--optimizer-cpu-offload and --offload-optimizer-states"]),
        (["--optimizer-cpu-offload", "--lora-rank", "8"], ["--optimizer-cpu-offload with --lora-rank"]),
        (["--stream-optimizer-state-to-disk"], ["--stream-optimizer-state-to-disk needs --offload-train-disk-dir"]),
        (["--stream-optimizer-state-moment-dtype", "bf16"], ["--stream-optimizer-state-moment-dtype=bf16"]),
        (["--stream-optimizer-state-moment-dtype", "fp16"], ["--stream-optimizer-state-moment-dtype='fp16' is not one of fp32, bf16"]),
        (["--offload-train-target", "disk", "--colocate"], ["--offload-train-target disk needs --offload-train-disk-dir"]),
        (["--offload-train-target", "disk", "--offload-train-disk-dir", "/tmp/x"], ["--offload-train-target disk: nothing"]),
        (["--offload-train-target", "tape"], ["--offload-train-target='tape' is not one of cpu, disk"]),
        (["--offload-train-disk-dir", "/tmp/x"], ["--offload-train-disk-dir is used by"]),
        (["--offload-train-disk-chunk-mb", "0"], ["--offload-train-disk-chunk-mb=0"]),
        (["--async-save", "--train-backend", "megatron"], ["--async-save", "megatron"]),
    ],
)  # fmt: skip
def test_refused_by_name(argv, words):
    text = _errors(argv)
    for w in words:
        assert w in text, text
