"""bench/gpu_matrix.py's CPU side: the commands it runs and how it judges a finished run."""

import json
from pathlib import Path

import pytest
import torch
import yaml

from miles.config import engine_dtype, load_config
from miles.workers.rollout_worker import embedded_options
from miles.workers.trainer_worker import push_dtype

from bench_modules import load_bench  # isort: skip  (same folder, rootdir on sys.path)
from harness import minimal_train_args  # isort: skip


@pytest.fixture(scope="module")
def matrix():
    return load_bench("gpu_matrix")


def test_every_run_is_a_valid_miles_train_command(matrix, tmp_path):
    for run in matrix.RUNS.values():
        cmd = matrix.command(run, tmp_path / run.name, tmp_path, [])
        assert cmd[1:4] == ["-m", "miles.cli", "train"]
        cfg = load_config(cmd[4:])  # parses and passes the start-up checks
        assert cfg.runtime.output_dir == str(tmp_path / run.name)
        if run.long_answers:
            rows = [json.loads(x) for x in (tmp_path / "arith_train_512.jsonl").read_text().splitlines()]
            assert rows and all(
                r["metadata"]["sampling_params"] == {"max_new_tokens": 512, "ignore_eos": True} for r in rows
            )
            assert cfg.rollout.rollout_stop == []


def _fake_run(out: Path, rewards: list[float], heldout: list[float], num_rollout: int) -> None:
    out.mkdir(parents=True)
    (out / "config.yaml").write_text(yaml.safe_dump({"rollout": {"num_rollout": num_rollout}}))
    rows = [{"step": -1, "eval/arith/reward_mean": heldout[0]}] if heldout else []
    for i, r in enumerate(rewards):
        row = {"step": i, "rollout/reward_mean": r, "perf/step_time": 1.0 + i, "sys/gpu0/util_percent": 50.0}
        if heldout and (i + 1) % 5 == 0:
            row["eval/arith/reward_mean"] = heldout[(i + 1) // 5]
        rows.append(row)
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_a_run_is_ok_only_when_it_finished_and_learned(matrix, tmp_path):
    demo = matrix.RUNS["disagg_1p1"]
    _fake_run(tmp_path / "up", [0.0, 0.1, 0.2, 0.3, 0.3, 0.3], [], 6)
    line = matrix.summarise(demo, tmp_path / "up", 0, 20.0, ["py", "-m", "miles.cli", "train"], 0.3, 1)
    assert line["ok"] and line["reward_first"] == 0.0 and line["reward_last"] == 0.3
    assert line["step_time_s"] == 4.0  # median of the steps after the first: 2, 3, 4, 5, 6
    assert line["sys_gpu_metrics"] == ["sys/gpu0/util_percent"]
    _fake_run(tmp_path / "flat", [0.2] * 6, [], 6)
    assert not matrix.summarise(demo, tmp_path / "flat", 0, 20.0, ["py"] * 4, 0.3, 1)["ok"]
    _fake_run(tmp_path / "short", [0.0, 0.5], [], 6)  # stopped early
    assert not matrix.summarise(demo, tmp_path / "short", 0, 20.0, ["py"] * 4, 0.3, 1)["ok"]
    assert not matrix.summarise(demo, tmp_path / "up", 1, 20.0, ["py"] * 4, 0.3, 1)["ok"]  # non-zero exit


def test_the_recipe_needs_its_heldout_gain(matrix, tmp_path):
    recipe = matrix.RUNS["smollm2_disagg"]
    _fake_run(tmp_path / "gain", [0.1] * 10, [0.2, 0.4, 0.55], 10)
    line = matrix.summarise(recipe, tmp_path / "gain", 0, 30.0, ["py"] * 4, 0.3, 1)
    assert line["ok"] and (line["heldout_first"], line["heldout_best"]) == (0.2, 0.55)
    _fake_run(tmp_path / "small", [0.1] * 10, [0.2, 0.3, 0.45], 10)
    assert not matrix.summarise(recipe, tmp_path / "small", 0, 30.0, ["py"] * 4, 0.3, 1)["ok"]


def test_weights_travel_in_the_dtype_the_engines_compute_in():
    assert push_dtype("auto", "cuda") is torch.bfloat16
    assert push_dtype("float32", "cuda") is torch.float32  # --dtype float32 on a GPU: no bf16 rounding on the way
    assert push_dtype("bfloat16", "cpu") is torch.bfloat16
    assert push_dtype("auto", "cpu") is None  # the fp32 master as it is
    assert push_dtype(engine_dtype("auto", {"dtype": "float"}), "cuda") is torch.float32  # --sglang-dtype float


def test_the_engines_get_sglang_dtype_over_the_trainers():
    from miles.config import load_config
    from miles.controller.placement import plan_placement

    base = minimal_train_args(num_rollout=2)
    for extra, want in (([], "auto"), (["--sglang-dtype", "float"], "float32"), (["--dtype", "float16"], "float16")):
        plan = plan_placement(load_config(base + extra), device="cuda", num_nodes=1, gpus_per_node=2, master_port=1)
        assert plan.rollout_specs[0].init_kwargs["dtype"] == want, extra


def test_an_sglang_engine_is_told_the_dtype_weights_are_pushed_in():
    """SGLang's own `auto` runs an fp32 checkpoint in float16, while the trainers push bf16 on GPU: the launcher
    passes --dtype, so the engine computes in what it receives (and what the docs say), unless the user chose."""
    from miles.config import load_config
    from miles.controller.placement import plan_placement
    from miles.engines.sglang_engine import build_sglang_command, with_engine_dtype

    base = minimal_train_args(num_rollout=2)
    base += ["--engine", "sglang"]
    for extra, want, pushed in (
        ([], "bfloat16", torch.bfloat16),
        (["--dtype", "float32"], "float32", torch.float32),
        (["--sglang-dtype", "half"], "half", torch.float16),  # the user's spelling goes to SGLang as given
    ):
        plan = plan_placement(load_config(base + extra), device="cuda", num_nodes=1, gpus_per_node=2, master_port=1)
        kwargs = plan.rollout_specs[0].init_kwargs
        cmd = build_sglang_command("/m", 1, sglang_args=with_engine_dtype(kwargs["sglang_args"], kwargs["dtype"]))
        assert cmd[cmd.index("--dtype") + 1] == want, extra
        assert push_dtype(kwargs["dtype"], "cuda") is pushed, extra


def test_the_embedded_engine_honours_disable_cuda_graph():
    assert embedded_options({"disable_cuda_graph": True}) == {"cuda_graphs": False}
    assert embedded_options({"mem_fraction_static": 0.8}) == {}
