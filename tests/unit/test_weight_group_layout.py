"""Weight-sync layouts for engines of several GPUs, and the SGLang request-field checks of the embedded front.

SGLang joins a weight-sync group with one rank per TP rank (`rank_offset + tp_rank`), and a colocated
engine's TP rank r shares the GPU of one trainer rank; these are checked here against hand-written
layouts and against the placement plan, without processes (tests/contract runs them against SGLang)."""

from __future__ import annotations

import pytest

from miles.config import load_config
from miles.controller.placement import plan_placement
from miles.engines.sglang_engine import build_sglang_command
from miles.engines.sglang_protocol import check_request_fields
from miles.weights.base import EngineUnsupportedError, engine_gpus, group_layout
from miles.weights.colocated import colocated_layout


@pytest.mark.parametrize(
    ("gpus", "first", "world", "offsets"),
    [
        ([1, 1, 1], 1, 4, [1, 2, 3]),  # one trainer source, engines of one GPU: rank 1 + i
        ([2, 2], 1, 5, [1, 3]),  # engines of two GPUs hold ranks 1-2 and 3-4
        ([1, 4, 2], 1, 8, [1, 2, 6]),  # mixed sizes: offsets count the GPUs before
        ([2, 1], 0, 3, [0, 2]),  # colocated: trainer ranks from 0
    ],
)
def test_group_layout(gpus, first, world, offsets):
    assert group_layout(gpus, first) == (world, offsets)


def test_engine_gpus_reads_tp_size_and_refuses_dp_and_pp():
    assert engine_gpus({"tp_size": 4, "dp_size": 1}, "e") == 4
    assert engine_gpus({}, "e") == 1  # an engine that reports nothing holds one rank
    for key in ("dp_size", "pp_size"):
        with pytest.raises(EngineUnsupportedError, match=f"{key}=2"):
            engine_gpus({"tp_size": 2, key: 2}, "e")


def test_colocated_layout_follows_the_placement_plan():
    """Engine i's TP rank r is served by the trainer rank whose GPU the placement gave that TP rank."""
    cfg = load_config(
        "--hf-checkpoint /m --prompt-data /p.jsonl --rm-type math --num-rollout 1 --rollout-batch-size 8 "
        "--n-samples-per-prompt 2 --engine sglang --colocate --actor-num-gpus-per-node 4 "
        "--rollout-num-engines 2 --rollout-num-gpus-per-engine 2".split()
    )
    plan = plan_placement(cfg, device="cuda", num_nodes=1, gpus_per_node=4, master_port=29500)
    trainer_gpu = {s.rank: int(s.env["CUDA_VISIBLE_DEVICES"]) for s in plan.trainer_specs}
    engine_gpus_ = [[int(g) for g in s.env["CUDA_VISIBLE_DEVICES"].split(",")] for s in plan.rollout_specs]
    assert [s.init_kwargs["tp_size"] for s in plan.rollout_specs] == [2, 2]
    layout = colocated_layout([2, 2])
    assert layout == {0: (0, 0), 1: (0, 1), 2: (1, 0), 3: (1, 1)}
    for rank, (engine, tp_rank) in layout.items():
        assert trainer_gpu[rank] == engine_gpus_[engine][tp_rank]


def test_an_engine_of_several_gpus_is_one_sglang_server_of_that_tp_size():
    cmd = build_sglang_command("/m", 30000, tp_size=2)
    assert cmd[cmd.index("--tp-size") + 1] == "2" and cmd.count("--port") == 1


@pytest.mark.parametrize(
    ("endpoint", "body", "needle"),
    [
        ("update_weights_from_distributed", {"names": [], "src_rank": 1}, "src_rank"),
        ("update_weights_from_tensor", {"serialized_named_tensors": [], "weight_version": 2}, "must be strings"),
        ("init_weights_update_group", {"master_address": "h", "master_port": 1, "tp_size": 2}, "tp_size"),
        ("update_weight_version", {"new_version": 3}, "must be strings"),
    ],
)
def test_fields_sglang_lacks_or_types_it_refuses_are_400(endpoint, body, needle):
    with pytest.raises(ValueError, match=needle):
        check_request_fields(endpoint, body)


def test_fields_sglang_has_and_endpoints_it_lacks_pass():
    check_request_fields("update_weights_from_distributed", {"names": [], "selector": "all", "weight_version": "1"})
    check_request_fields("pull_weights", {"anything": 1})  # Miles' fork endpoint: not SGLang's to judge
