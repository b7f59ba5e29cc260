"""--expert-model-parallel-size / --expert-tensor-parallel-size and routing replay under --train-backend megatron:
accepted where the megatron MoE path runs them, refused in one line naming the flag elsewhere."""

from __future__ import annotations

import pytest

from miles.config import ConfigError, load_config
from miles.trainer.moe_layout import check_moe_layout

BASE = {"hf_checkpoint": "m", "prompt_data": "p.jsonl", "rm_type": "math", "rollout_batch_size": 8, "num_rollout": 1}
MEGATRON = ("--train-backend", "megatron", "--actor-num-gpus-per-node", "4")


def _cfg(*argv: str):
    return load_config(list(argv), base=BASE)


def test_expert_parallel_flags_are_read_under_megatron():
    cfg = _cfg(*MEGATRON, "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "2")
    assert (cfg.train.expert_model_parallel_size, cfg.train.expert_tensor_parallel_size) == (2, 2)
    assert cfg.dp_size == 4  # expert parallelism splits the data-parallel ranks for the experts only


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--expert-model-parallel-size", "2"), "--expert-model-parallel-size need --train-backend megatron"),
        (("--expert-tensor-parallel-size", "2"), "--expert-tensor-parallel-size need --train-backend megatron"),
        ((*MEGATRON, "--expert-model-parallel-size", "3"), "--expert-model-parallel-size=3 x"),
        ((*MEGATRON, "--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "4"), "must divide the 2"),
        ((*MEGATRON, "--use-rollout-routing-replay", "--pipeline-model-parallel-size", "2"), "replay needs every"),
        ((*MEGATRON, "--use-routing-replay", "--gradient-checkpointing"), "a recomputed router would not replay"),
        ((*MEGATRON, "--use-rollout-routing-replay", "--tensor-model-parallel-size", "2", "--sequence-parallel"),
         "routers see a sequence shard"),
    ],
)  # fmt: skip
def test_layouts_that_cannot_run_are_refused_by_name(argv, message):
    with pytest.raises(ConfigError, match=message):
        _cfg(*argv)


def test_routing_replay_is_accepted_under_megatron():
    cfg = _cfg(*MEGATRON, "--use-rollout-routing-replay", "--expert-model-parallel-size", "2")
    assert cfg.train.use_routing_replay and cfg.train.use_rollout_routing_replay


def test_the_model_dependent_layout_is_checked_once_the_model_is_known():
    check_moe_layout(4, tp=2, sequence_parallel=True, ep=2, etp=1)
    with pytest.raises(ValueError, match="--tensor-model-parallel-size=2 on an MoE model needs --sequence-parallel"):
        check_moe_layout(4, tp=2, sequence_parallel=False, ep=1, etp=1)
    with pytest.raises(ValueError, match="the model is dense"):
        check_moe_layout(0, tp=1, sequence_parallel=False, ep=2, etp=1)


def test_start_up_checks_the_expert_layout_against_the_model(tmp_path):
    import json
    import types

    from miles.trainer.moe_layout import check_megatron_model

    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "qwen3_moe", "num_experts": 4, "moe_intermediate_size": 64})
    )
    train = types.SimpleNamespace(
        train_backend="megatron", expert_model_parallel_size=4, expert_tensor_parallel_size=2,
        tensor_model_parallel_size=1, sequence_parallel=False,
    )  # fmt: skip
    check_megatron_model(train, str(tmp_path))
    train.expert_model_parallel_size = 8
    with pytest.raises(ValueError, match="--expert-model-parallel-size=8 must divide the model's 4 experts"):
        check_megatron_model(train, str(tmp_path))
    train.expert_model_parallel_size, train.expert_tensor_parallel_size = 1, 3
    with pytest.raises(ValueError, match="--expert-tensor-parallel-size=3 must divide"):
        check_megatron_model(train, str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    with pytest.raises(ValueError, match="the model is dense"):
        check_megatron_model(train, str(tmp_path))
