"""Trainer world, data-parallel size and shard assignment under --train-backend megatron."""

from __future__ import annotations

from miles.config import load_config

BASE = {"hf_checkpoint": "m", "prompt_data": "p.jsonl", "rm_type": "math", "rollout_batch_size": 8, "num_rollout": 1}


def _cfg(*argv: str):
    return load_config(list(argv), base=BASE)


def test_fsdp_world_is_all_data_parallel():
    cfg = _cfg("--actor-num-gpus-per-node", "4")
    assert (cfg.trainer_world_size, cfg.dp_size) == (4, 4)
    assert [cfg.dp_rank_of(r) for r in range(4)] == [0, 1, 2, 3]


def test_megatron_replicas_follow_megatron_rank_order():
    # megatron-core's default order tp-cp-ep-dp-pp: TP fastest, PP slowest.
    # 8 ranks, TP=2, PP=2 -> DP=2: rank = tp + 2 * dp + 4 * pp
    cfg = _cfg(
        "--train-backend", "megatron", "--actor-num-gpus-per-node", "8",
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
    )  # fmt: skip
    assert (cfg.trainer_world_size, cfg.model_parallel_size, cfg.dp_size) == (8, 4, 2)
    assert [cfg.dp_rank_of(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]


def test_placement_starts_the_whole_trainer_world():
    from miles.controller.placement import plan_placement

    cfg = _cfg(
        "--train-backend", "megatron", "--actor-num-gpus-per-node", "4", "--tensor-model-parallel-size", "2",
        "--rollout-num-engines", "2",
    )  # fmt: skip
    placement = plan_placement(cfg, num_nodes=1, gpus_per_node=8, device="cuda")
    assert len(placement.trainer_specs) == 4
    assert {s.env["WORLD_SIZE"] for s in placement.trainer_specs} == {"4"}
