"""Placement: trainers, rollout engines and eval engines on nodes and GPUs; the machine a run plans for."""

from __future__ import annotations

import sys

import pytest

from miles.config import load_config
from miles.controller.machine import Machine, detect_gpus_per_node, resolve_machine, torch_has_gpu_build
from miles.controller.placement import PlacementError, plan_placement
from miles.wire.launch_env import launch_env
from miles.wire.specs import validate_specs

# 96 samples per step: divisible by the 1, 2, 3, 4, 6, 8, 16 and 32 trainer ranks used below; SGLang engines
# (the embedded engine is refused with more than one GPU per engine)
BASE = (
    "--hf-checkpoint /m --prompt-data /p.jsonl --rm-type math --num-rollout 2 --rollout-batch-size 24 "
    "--n-samples-per-prompt 4 --engine sglang"
)


def cfg_of(*flags: str):
    return load_config([*BASE.split(), *flags])


def layout(cfg, *, nodes: int, gpus: int) -> list[tuple[str, int, int, list[int]]]:
    """(role, rank, node, local GPUs) of every worker of a GPU plan; the plan must pass validate_specs."""
    p = plan_placement(cfg, device="cuda", num_nodes=nodes, gpus_per_node=gpus, master_port=29500)
    validate_specs(p.specs, "tcp" if nodes > 1 else "ipc", nodes)
    return [(w["role"], w["rank"], w["node"], w["gpus"]) for w in p.summary()["workers"]]


def refusal(cfg, *, nodes: int, gpus: int) -> str:
    with pytest.raises(PlacementError) as info:
        plan_placement(cfg, device="cuda", num_nodes=nodes, gpus_per_node=gpus, master_port=29500)
    assert "\n" not in str(info.value)
    return str(info.value)


# ---------------------------------------------------------------- GPU plans, separate engines


def test_two_gpus_one_node_trainer_then_engine():
    assert layout(cfg_of(), nodes=1, gpus=2) == [("trainer", 0, 0, [0]), ("rollout", 0, 0, [1])]


def test_one_gpu_per_node_engine_goes_to_the_next_node():
    cfg = cfg_of("--rollout-num-engines", "2")
    assert layout(cfg, nodes=3, gpus=1) == [("trainer", 0, 0, [0]), ("rollout", 0, 1, [0]), ("rollout", 1, 2, [0])]


def test_eight_gpus_one_node_engines_of_two():
    cfg = cfg_of("--actor-num-gpus-per-node", "4", "--rollout-num-engines", "2", "--rollout-num-gpus-per-engine", "2")
    assert layout(cfg, nodes=1, gpus=8) == [("trainer", r, 0, [r]) for r in range(4)] + [
        ("rollout", 0, 0, [4, 5]),
        ("rollout", 1, 0, [6, 7]),
    ]


def test_four_nodes_of_eight_trainers_on_two_engines_of_four_on_the_rest():
    cfg = cfg_of(
        "--actor-num-nodes",
        "2",
        "--actor-num-gpus-per-node",
        "8",
        "--rollout-num-engines",
        "4",
        "--rollout-num-gpus-per-engine",
        "4",
    )
    got = layout(cfg, nodes=4, gpus=8)
    assert got[:16] == [("trainer", r, r // 8, [r % 8]) for r in range(16)]
    assert got[16:] == [
        ("rollout", 0, 2, [0, 1, 2, 3]),
        ("rollout", 1, 2, [4, 5, 6, 7]),
        ("rollout", 2, 3, [0, 1, 2, 3]),
        ("rollout", 3, 3, [4, 5, 6, 7]),
    ]


def test_engines_fill_a_trainer_node_first_but_never_straddle():
    # node 0: trainers on GPUs 0-5, GPUs 6-7 free; node 1: all 8 free
    two = cfg_of("--actor-num-gpus-per-node", "6", "--rollout-num-engines", "3", "--rollout-num-gpus-per-engine", "2")
    assert layout(two, nodes=2, gpus=8)[6:] == [
        ("rollout", 0, 0, [6, 7]),
        ("rollout", 1, 1, [0, 1]),
        ("rollout", 2, 1, [2, 3]),
    ]
    four = cfg_of("--actor-num-gpus-per-node", "6", "--rollout-num-engines", "2", "--rollout-num-gpus-per-engine", "4")
    assert layout(four, nodes=2, gpus=8)[6:] == [("rollout", 0, 1, [0, 1, 2, 3]), ("rollout", 1, 1, [4, 5, 6, 7])]


def test_enough_gpus_in_total_but_not_on_one_node_is_refused():
    # 2 nodes x 4 GPUs, 3 trainers on each: one free GPU per node, an engine of 2 fits nowhere
    cfg = cfg_of("--actor-num-nodes", "2", "--actor-num-gpus-per-node", "3", "--rollout-num-gpus-per-engine", "2")
    msg = refusal(cfg, nodes=2, gpus=4)
    assert "rollout engine 0 needs 2 GPUs on one node" in msg and "[1, 1]" in msg


def test_trainer_env_on_gpu():
    cfg = cfg_of("--actor-num-nodes", "2", "--actor-num-gpus-per-node", "2")
    p = plan_placement(cfg, device="cuda", num_nodes=2, gpus_per_node=4, master_addr="node0", master_port=29502)
    env = p.trainer_specs[3].env
    assert (p.trainer_specs[3].node, env["CUDA_VISIBLE_DEVICES"], env["LOCAL_RANK"]) == (1, "1", "0")
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == ("3", "4", "2")
    assert (env["MASTER_ADDR"], env["MASTER_PORT"], env["TORCHELASTIC_USE_AGENT_STORE"]) == ("node0", "29502", "False")
    assert env["MILES_NUM_NODES"] == "2"
    assert p.rollout_specs[0].env["CUDA_VISIBLE_DEVICES"] == "2" and p.rollout_specs[0].node == 0
    assert p.rollout_specs[0].init_kwargs["tp_size"] == 1 and p.gpus_needed == 5


# ---------------------------------------------------------------- colocated


def test_colocated_engines_share_the_trainer_gpus():
    cfg = cfg_of(
        "--colocate",
        "--actor-num-gpus-per-node",
        "8",
        "--rollout-num-engines",
        "4",
        "--rollout-num-gpus-per-engine",
        "2",
    )
    got = layout(cfg, nodes=1, gpus=8)
    assert got[8:] == [("rollout", i, 0, [2 * i, 2 * i + 1]) for i in range(4)]
    p = plan_placement(cfg, device="cuda", num_nodes=1, gpus_per_node=8, master_port=29500)
    assert p.colocated and p.gpus_needed == 8


def test_colocated_across_nodes_engine_per_node():
    cfg = cfg_of(
        "--colocate",
        "--actor-num-nodes",
        "2",
        "--actor-num-gpus-per-node",
        "4",
        "--rollout-num-engines",
        "2",
        "--rollout-num-gpus-per-engine",
        "4",
    )
    assert layout(cfg, nodes=2, gpus=4)[8:] == [("rollout", 0, 0, [0, 1, 2, 3]), ("rollout", 1, 1, [0, 1, 2, 3])]


def test_colocated_refusals():
    straddle = cfg_of(
        "--colocate",
        "--actor-num-nodes",
        "2",
        "--actor-num-gpus-per-node",
        "3",
        "--rollout-num-engines",
        "2",
        "--rollout-num-gpus-per-engine",
        "2",
    )
    msg = refusal(straddle, nodes=2, gpus=4)
    assert "engine 1 would span nodes [0, 1]" in msg and "divides 3" in msg
    too_many = cfg_of("--colocate", "--actor-num-gpus-per-node", "2", "--rollout-num-engines", "3")
    msg = refusal(too_many, nodes=1, gpus=8)
    assert "3 engine(s) x 1 GPUs = 3 but the trainers hold 2" in msg and "at most 2" in msg


# ---------------------------------------------------------------- dedicated eval engines


def test_eval_engines_take_gpus_after_the_rollout_engines():
    cfg = cfg_of("--fully-async", "--eval-mode", "dedicated", "--eval-num-engines", "2")
    p = plan_placement(cfg, device="cuda", num_nodes=1, gpus_per_node=4, master_port=29500)
    assert [(w["role"], w["rank"], w["node"], w["gpus"]) for w in p.summary()["workers"]] == [
        ("trainer", 0, 0, [0]),
        ("rollout", 0, 0, [1]),
        ("eval_rollout", 0, 0, [2]),
        ("eval_rollout", 1, 0, [3]),
    ]
    assert [s.init_kwargs["seed"] for s in p.eval_specs] == [42 + 10_000, 42 + 10_001]
    assert p.eval_specs[0].init_kwargs["model_path"] == "/m" and p.gpus_needed == 4


def test_eval_engines_on_the_next_node():
    cfg = cfg_of(
        "--fully-async",
        "--eval-mode",
        "dedicated",
        "--eval-num-engines",
        "1",
        "--actor-num-gpus-per-node",
        "2",
        "--rollout-num-gpus-per-engine",
        "2",
    )
    got = layout(cfg, nodes=3, gpus=2)
    assert got[2:] == [("rollout", 0, 1, [0, 1]), ("eval_rollout", 0, 2, [0, 1])]


def test_eval_engines_only_when_fully_async():
    cfg = cfg_of()
    cfg.eval.eval_num_engines = 2  # refused by the config checks; the plan still starts none
    p = plan_placement(cfg, device="cuda", num_nodes=1, gpus_per_node=2, master_port=29500)
    assert p.eval_specs == []


# ---------------------------------------------------------------- refusals


def test_refusal_names_what_is_needed_and_what_exists():
    cfg = cfg_of("--actor-num-gpus-per-node", "8", "--rollout-num-engines", "2")
    assert refusal(cfg, nodes=1, gpus=8).startswith(
        "placement needs 10 GPUs (8 for trainers + 2 rollout engine(s) x 1) but the cluster has 8 "
        "(1 node(s) x 8 GPUs); lower --actor-num-nodes, --actor-num-gpus-per-node, --rollout-num-engines"
    )
    evals = cfg_of(
        "--fully-async", "--eval-mode", "dedicated", "--eval-num-engines", "1", "--rollout-num-gpus-per-engine", "2"
    )
    assert (
        "needs 5 GPUs (1 for trainers + 1 rollout engine(s) x 2 + 1 eval engine(s) x 2) but the cluster has 4 "
        "(2 node(s) x 2 GPUs)" in refusal(evals, nodes=2, gpus=2)
    )


def test_refusals_of_impossible_shapes():
    assert "--actor-num-gpus-per-node=4 but a node has 2 GPUs" in refusal(
        cfg_of("--actor-num-gpus-per-node", "4"), nodes=4, gpus=2
    )
    assert "--rollout-num-gpus-per-engine=4 but a node has 2 GPUs" in refusal(
        cfg_of("--rollout-num-gpus-per-engine", "4"), nodes=4, gpus=2
    )
    assert "--actor-num-nodes=2 but the job has 1 node(s)" in refusal(
        cfg_of("--actor-num-nodes", "2"), nodes=1, gpus=8
    )


# ---------------------------------------------------------------- CPU plans (processes only)


def test_cpu_plan_one_node():
    cfg = cfg_of("--actor-num-gpus-per-node", "2", "--rollout-num-engines", "2")
    p = plan_placement(cfg, device="cpu", num_nodes=1, master_port=29500)
    assert [(s.name, s.node) for s in p.specs] == [
        ("trainer:0", 0),
        ("trainer:1", 0),
        ("rollout:0", 0),
        ("rollout:1", 0),
    ]
    assert all("CUDA_VISIBLE_DEVICES" not in s.env for s in p.specs)
    assert p.trainer_specs[1].env["LOCAL_RANK"] == "1" and p.summary()["gpus_needed"] == 0


def test_cpu_plan_engines_round_robin_after_the_trainer_nodes():
    cfg = cfg_of("--rollout-num-engines", "3", "--fully-async", "--eval-mode", "dedicated", "--eval-num-engines", "1")
    p = plan_placement(cfg, device="cpu", num_nodes=2, master_port=29500)
    assert [(s.name, s.node) for s in p.specs] == [
        ("trainer:0", 0),
        ("rollout:0", 1),
        ("rollout:1", 0),
        ("rollout:2", 1),
        ("eval_rollout:0", 1),
    ]
    assert all(s.env["MILES_NUM_NODES"] == "2" for s in p.specs)
    validate_specs(p.specs, "tcp", 2)


# ---------------------------------------------------------------- the machine


def test_detect_gpus_per_node_order():
    assert detect_gpus_per_node({"SLURM_GPUS_ON_NODE": "4", "LOCAL_WORLD_SIZE": "2"}, 8) == 8
    assert detect_gpus_per_node({"SLURM_GPUS_ON_NODE": "4", "LOCAL_WORLD_SIZE": "2"}, 0) == 4
    assert detect_gpus_per_node({"LOCAL_WORLD_SIZE": "2"}, None) == 2
    assert detect_gpus_per_node({"SLURM_GPUS_ON_NODE": "gpu:4", "LOCAL_WORLD_SIZE": "0"}, 0) is None
    assert detect_gpus_per_node({}, 0) is None


def runtime_of(*flags: str):
    return cfg_of(*flags).runtime


SINGLE = launch_env({})
TORCHRUN_2 = launch_env({"GROUP_RANK": "0", "GROUP_WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "n0"})


def test_machine_from_cuda_and_launch():
    assert resolve_machine(runtime_of(), SINGLE, cuda_count=2, environ={}) == Machine("cuda", 1, 2)
    assert resolve_machine(runtime_of(), TORCHRUN_2, cuda_count=8, environ={}) == Machine("cuda", 2, 8)
    assert resolve_machine(runtime_of("--num-gpus-per-node", "4"), SINGLE, cuda_count=8) == Machine("cuda", 1, 4)
    assert resolve_machine(runtime_of(), SINGLE, cuda_count=0, environ={"SLURM_GPUS_ON_NODE": "4"}) == Machine(
        "cpu", 1, 0
    )  # no CUDA: a CPU plan whatever the environment says


def test_num_nodes_must_match_the_launch_in_a_real_run():
    with pytest.raises(PlacementError, match=r"--num-nodes=2 but the launch environment \(single\) has 1 node"):
        resolve_machine(runtime_of("--num-nodes", "2"), SINGLE, cuda_count=2)
    assert resolve_machine(runtime_of("--num-nodes", "2"), TORCHRUN_2, cuda_count=2).num_nodes == 2
    assert resolve_machine(runtime_of("--num-nodes", "4"), SINGLE, dry_run=True, cuda_count=0).num_nodes == 4


def test_gpu_flag_refusals_in_a_real_run():
    with pytest.raises(PlacementError, match="CUDA is not available"):
        resolve_machine(runtime_of("--num-gpus-per-node", "2"), SINGLE, cuda_count=0)
    with pytest.raises(PlacementError, match="shows 2 CUDA device"):
        resolve_machine(runtime_of("--num-gpus-per-node", "8"), SINGLE, cuda_count=2)
    with pytest.raises(PlacementError, match="--num-nodes=0"):
        resolve_machine(runtime_of("--num-nodes", "0"), SINGLE, dry_run=True)
    # a dry run plans a GPU layout on a CPU machine when told the GPUs per node
    dry = resolve_machine(
        runtime_of("--num-gpus-per-node", "8", "--num-nodes", "2"), SINGLE, dry_run=True, cuda_count=0
    )
    assert dry == Machine("cuda", 2, 8)


def test_worker_gpus_are_translated_through_the_launchers_visible_devices():
    from miles.wire.procs import visible_devices

    assert visible_devices("1", None) == "1"  # nothing restricted: the node's own numbering
    assert visible_devices("0", "1") == "1"  # `CUDA_VISIBLE_DEVICES=1 miles train`: its GPU 0 is the node's 1
    assert visible_devices("0,1", "2, 3") == "2,3"
    assert visible_devices("1", "GPU-aaa,GPU-bbb") == "GPU-bbb"
    assert visible_devices("", "2,3") == ""  # a CPU worker stays without GPUs
    with pytest.raises(ValueError, match="sees only 2"):
        visible_devices("2", "2,3")


def test_visible_devices_count_as_cuda_reads_them():
    from miles.controller.machine import visible_count

    assert visible_count(None, 4) == 4
    assert visible_count("2,3", 8) == 2
    assert visible_count("", 4) == 0
    assert visible_count("1,-1,2", 4) == 1  # CUDA stops at the first invalid entry
    assert visible_count("0,1,2,3,4,5", 2) == 2  # never more than the machine has


def _fake_torch(tmp_path, monkeypatch, version_py: str | None) -> None:
    pkg = tmp_path / "torch"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise ImportError('the probe must not import torch')\n")
    if version_py is not None:
        (pkg / "version.py").write_text(version_py)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "torch", raising=False)


@pytest.mark.parametrize(
    ("version_py", "gpu"),
    [
        ("cuda: Optional[str] = None\nhip: Optional[str] = None\n", False),
        ("cuda: Optional[str] = '13.0'\nhip: Optional[str] = None\n", True),
        ("cuda = None\nhip = '6.2'\n", True),
        ("__version__ = '9.9'\n", True),  # no cuda/hip lines: unusual, so torch is asked
        (None, True),  # no version.py
    ],
)
def test_torch_build_read_without_importing_torch(tmp_path, monkeypatch, version_py, gpu):
    _fake_torch(tmp_path, monkeypatch, version_py)
    assert torch_has_gpu_build() is gpu
    assert "torch" not in sys.modules
