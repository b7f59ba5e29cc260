"""The `miles` command: dispatch, help groups, exit codes, plotting."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import yaml

from miles.cli import main
from miles.config import SECTIONS
from miles.config.docs import render_markdown
from miles.utils.plot import ascii_curve

from harness import minimal_train_args, requires  # isort: skip

TRAIN = ["train", *minimal_train_args(num_rollout=2)]


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # default run directories (runs/...) land here


def fake_module(monkeypatch, name: str, **attrs) -> None:
    monkeypatch.setitem(sys.modules, name, types.SimpleNamespace(**attrs))


def test_top_level_help_is_lazy():
    code = (
        "import sys; from miles.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit as e:\n    assert e.code == 0\n"
        "heavy = [m for m in ('torch', 'transformers', 'matplotlib', 'yaml') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=root)
    assert proc.returncode == 0, proc.stderr
    for command in ("train", "tiny-model", "engine", "config", "plot", "sweep", "convert"):
        assert command in proc.stdout


def test_train_help_lists_groups_in_section_order(capsys):
    with pytest.raises(SystemExit) as info:
        main(["train", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    order = [f"\n{section.rstrip('_')}:\n" for section in SECTIONS]  # the YAML sections, in MilesConfig's order
    positions = [out.index(g) for g in order]
    assert positions == sorted(positions)
    assert "--rollout-batch-size" in out and "--no-colocate" in out
    assert "--sglang-args" not in out  # cli=False fields are YAML-only
    assert "--dry-run" in out and "--num-gpus-per-node" in out and "--num-nodes" in out


def test_config_error_exits_2_without_traceback(capsys):
    assert main([*TRAIN, "--rollout-bach-size", "3"]) == 2
    err = capsys.readouterr().err
    assert "--rollout-bach-size" in err and "--rollout-batch-size" in err and "Traceback" not in err


def test_train_without_loop_module(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "miles.controller.loop_sync", None)  # import fails as if absent
    assert main(TRAIN) == 2
    assert "miles train: the training loop is not available yet" in capsys.readouterr().err


def test_train_dispatches_sync_and_async(monkeypatch, tmp_path):
    seen = {}
    prompts = tmp_path / "p.jsonl"  # names a file: a missing one is refused before any loop starts
    prompts.write_text("")
    train = ["train", *minimal_train_args(num_rollout=2, prompt_data=str(prompts))]

    def sync_run(cfg):
        seen["sync"] = cfg
        return 0

    async def async_run(cfg):
        seen["async"] = cfg
        return 0

    fake_module(monkeypatch, "miles.controller.loop_sync", run=sync_run)
    fake_module(monkeypatch, "miles.controller.loop_async", run=async_run)
    # the model spec is resolved before the loop gets the config
    monkeypatch.setattr(
        "miles.models.resolve.resolve_model_paths", lambda model, seed: seen.setdefault("model", model)
    )
    assert main(train) == 0
    cfg = seen["sync"]
    assert seen["model"] is cfg.model
    assert cfg.rollout.rollout_batch_size == 4 and "async" not in seen
    saved = yaml.safe_load((Path(cfg.runtime.output_dir) / "config.yaml").read_text())
    assert saved["rollout"]["global_batch_size"] == 4 and saved["model"]["hf_checkpoint"] == "/m"
    assert main([*train, "--fully-async"]) == 0
    assert seen["async"].async_.fully_async is True


ROOT = Path(__file__).resolve().parents[2]
NO_LAUNCHER = ("GROUP_RANK", "GROUP_WORLD_SIZE", "LOCAL_WORLD_SIZE", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NNODES")


def _cli(tmp_path, *args: str) -> subprocess.CompletedProcess:
    """`python -m miles.cli train` in tmp_path, outside any torchrun/Slurm job, with its own model cache."""
    env = {k: v for k, v in os.environ.items() if k not in NO_LAUNCHER}
    env["MILES_CACHE"] = str(tmp_path / "cache")
    cmd = [sys.executable, "-m", "miles.cli", "train", "--config", str(ROOT / "launch/configs/demo_cpu.yaml"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)


def test_dry_run_prints_config_and_plan_and_starts_nothing(tmp_path):
    proc = _cli(tmp_path, "--dry-run", "--num-gpus-per-node", "2")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["placement"] == {
        "device": "cuda",
        "num_nodes": 1,
        "gpus_per_node": 2,
        "gpus_needed": 2,
        "workers": [
            {"role": "trainer", "rank": 0, "node": 0, "gpus": [0]},
            {"role": "rollout", "rank": 0, "node": 0, "gpus": [1]},
        ],
    }
    assert out["config"]["model"]["hf_checkpoint"] == "tiny:qwen2:2x64"  # no model built
    assert out["config"]["rollout"]["rollout_batch_size"] == 16
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no run directory, no model cache


def test_real_run_refuses_num_nodes_the_launch_does_not_have(tmp_path):
    proc = _cli(tmp_path, "--num-nodes", "2")
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("placement error: --num-nodes=2 but the launch environment (single) has 1 node(s)")
    assert "Traceback" not in proc.stderr and not (tmp_path / "cache").exists()  # refused before the model is built


def test_dry_run_on_several_nodes(capsys):
    flags = ["--dry-run", "--num-nodes", "2", "--num-gpus-per-node", "1", "--rollout-num-engines", "1"]
    assert main([*TRAIN, *flags]) == 0
    plan = json.loads(capsys.readouterr().out)["placement"]
    assert (plan["num_nodes"], plan["gpus_needed"]) == (2, 2)
    assert [(w["role"], w["node"], w["gpus"]) for w in plan["workers"]] == [("trainer", 0, [0]), ("rollout", 1, [0])]


def test_dry_run_refusal_is_one_line_exit_2(capsys):
    assert main([*TRAIN, "--dry-run", "--num-gpus-per-node", "1"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        "placement error: placement needs 2 GPUs (1 for trainers + 1 rollout engine(s) x 1) but the cluster has 1 "
        "(1 node(s) x 1 GPUs); lower --actor-num-nodes, --actor-num-gpus-per-node, --rollout-num-engines or "
        "--eval-num-engines, use --colocate, or run on more nodes\n"
    )


def test_forwarding_subcommands(monkeypatch):
    calls = []
    fake_module(monkeypatch, "miles.models.tiny", main=lambda argv: calls.append(("tiny", argv)) or 0)
    fake_module(monkeypatch, "miles.engines.http_front", serve_main=lambda argv: calls.append(("serve", argv)) or 0)
    assert main(["tiny-model", "/out", "--arch", "llama", "--layers", "2"]) == 0
    assert main(["engine", "serve", "--model-path", "/m", "--port", "30000"]) == 0
    assert calls == [
        ("tiny", ["/out", "--arch", "llama", "--layers", "2"]),
        ("serve", ["--model-path", "/m", "--port", "30000"]),
    ]
    assert main(["engine", "start"]) == 2


def test_config_markdown_prints_the_reference(capsys):
    assert main(["config", "--markdown"]) == 0
    assert capsys.readouterr().out == render_markdown()


def test_convert_gguf_missing_dependency(monkeypatch, capsys, tmp_path):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real_find_spec(name, *a)
    )
    assert main(["convert", "gguf", str(tmp_path / "m.gguf"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "gguf" in err and "pip install 'miles[gguf]'" in err and "Traceback" not in err


def test_unknown_command_exits_2(capsys):
    with pytest.raises(SystemExit) as info:
        main(["trian"])
    assert info.value.code == 2


# ---------------------------------------------------------------- plots


@requires("matplotlib")
def test_plot_writes_pngs_for_known_keys(tmp_path, capsys):
    rows = [
        {"step": 0, "rollout/reward_mean": 0.1, "train/kl_loss": 0.0, "rollout/other": 5},
        {
            "step": 1,
            "rollout/reward_mean": 0.4,
            "eval/gsm8k/reward_mean": 0.2,
            "eval/gsm8k/num_samples": 64,
            "perf/step_time": 3.0,
        },
        {
            "step": 2,
            "rollout/reward_mean": 0.9,
            "train/train_rollout_kl": 0.01,
            "rollout/fully_async/avg_staleness": 1.5,
        },
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\nnot json\n")
    assert main(["plot", str(tmp_path)]) == 0
    names = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert names == sorted(
        [
            "rollout_reward_mean.png",
            "train_kl_loss.png",
            "eval_gsm8k_reward_mean.png",
            "perf_step_time.png",
            "train_train_rollout_kl.png",
            "rollout_fully_async_avg_staleness.png",
        ]
    )
    assert all((tmp_path / "plots" / n).read_bytes()[:4] == b"\x89PNG" for n in names)
    assert "rollout/reward_mean" in capsys.readouterr().out


@requires("matplotlib")
@pytest.mark.parametrize("plot_curves", [True, False])
def test_a_run_ends_with_its_plots_unless_told_not_to(tmp_path, capsys, plot_curves):
    from miles.config import MilesConfig
    from miles.controller.run import run_driver

    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0, "rollout/reward_mean": 0.1}) + "\n")
    cfg = MilesConfig()
    cfg.logging.plot_curves = plot_curves

    async def train(_cfg):
        return str(tmp_path)

    assert run_driver(train, cfg) == 0
    assert "reward curve (rollout/reward_mean, 1 steps)" in capsys.readouterr().out
    assert (tmp_path / "plots" / "rollout_reward_mean.png").exists() == plot_curves


def test_plot_missing_metrics_exits_2(tmp_path, capsys):
    assert main(["plot", str(tmp_path)]) == 2
    assert "metrics.jsonl not found" in capsys.readouterr().err


def test_plot_without_matplotlib_says_which_extra_to_install(tmp_path, capsys, monkeypatch):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0, "rollout/reward_mean": 0.1}) + "\n")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    assert main(["plot", str(tmp_path)]) == 2
    assert "miles plot: PNG curves need matplotlib: pip install 'miles[plot]'" in capsys.readouterr().err
    assert not (tmp_path / "plots").exists()


def _grid(text: str) -> list[str]:
    return [line.split("|", 1)[1] for line in text.splitlines()]


def test_ascii_curve_rising_values():
    text = ascii_curve(list(range(10)), width=10, height=5)
    rows = _grid(text)
    assert len(rows) == 5 and all(len(r) == 10 for r in rows)
    assert rows[0][9] == "*" and rows[4][0] == "*"  # highest value top-right, lowest bottom-left
    assert all(sum(r[c] == "*" for r in rows) == 1 for c in range(10))  # one mark per column
    assert text.splitlines()[0].split("|")[0].strip() == "9" and text.splitlines()[-1].split("|")[0].strip() == "0"


def test_ascii_curve_buckets_long_series():
    text = ascii_curve(list(range(100)), width=10, height=3)
    # ten buckets of ten values: means 4.5, 14.5, ..., 94.5
    assert text.splitlines()[0].split("|")[0].strip() == "94.5"
    assert text.splitlines()[-1].split("|")[0].strip() == "4.5"
    assert ascii_curve([], 10, 3) == ""
    assert all(len(r) == 1 for r in _grid(ascii_curve([2.0], 10, 3)))  # flat series: no division by zero


TORCH_OOM = (
    "CUDA out of memory. Tried to allocate 5.30 GiB. GPU 0 has a total capacity of 139.80 GiB of which 4.82 GiB is "
    "free. Process 1800 has 118.12 GiB memory in use. Of the allocated memory 15.92 GiB is allocated by PyTorch."
)


@pytest.mark.parametrize("where", ["engine", "trainer"])
def test_out_of_gpu_memory_ends_the_run_with_one_line_saying_what_to_change(monkeypatch, tmp_path, capsys, where):
    from miles.cli import EXIT_RUN_FAILED
    from miles.engines.client import EngineHTTPError
    from miles.wire.rpc import RemoteError

    if where == "engine":
        body = json.dumps({"error": f"OutOfMemoryError: {TORCH_OOM}"})
        error = EngineHTTPError(500, "http://10.0.0.2:30000", "/resume_memory_occupation", body)
    else:
        error = RemoteError("trainer:0", "train", "OutOfMemoryError", TORCH_OOM, "Traceback ...")

    def sync_run(cfg):
        raise error

    fake_module(monkeypatch, "miles.controller.loop_sync", run=sync_run)
    monkeypatch.setattr("miles.models.resolve.resolve_model_paths", lambda model, seed: None)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("")
    assert main(["train", *minimal_train_args(num_rollout=2, prompt_data=str(prompts))]) == EXIT_RUN_FAILED
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    who = "engine http://10.0.0.2:30000 on /resume_memory_occupation" if where == "engine" else "trainer:0.train()"
    assert lines[0].startswith(f"miles train: {who} ran out of GPU memory (Tried to allocate 5.30 GiB; ")
    assert "Process 1800 has 118.12 GiB memory in use" in lines[0] and "--max-tokens-per-gpu" in lines[0]


def test_an_error_that_is_not_out_of_memory_keeps_its_traceback():
    from miles.cli import one_line
    from miles.engines.client import EngineHTTPError

    assert one_line(EngineHTTPError(500, "http://h:1", "/generate", '{"error": "KeyError: x"}')) is None
    assert one_line(ValueError("CUDA out of memory")) is None  # not an engine's answer nor a worker's error


def test_the_out_of_memory_hint_names_only_the_levers_the_run_has_not_pulled():
    from miles.config import load_config
    from miles.errors import out_of_memory_hint

    cfg = load_config(minimal_train_args("--colocate", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "32768"))
    cfg.train.offload_train = cfg.train.offload_rollout = True  # as the start-up check resolved them
    hint = out_of_memory_hint(cfg)
    assert "lower --max-tokens-per-gpu (now 32768)" in hint and "--gradient-checkpointing" in hint
    assert "pass --offload-train" not in hint and "offload is on" in hint

    cfg = load_config(minimal_train_args("--colocate", "--gradient-checkpointing", "--micro-batch-size", "4"))
    cfg.train.offload_train = cfg.train.offload_rollout = False
    hint = out_of_memory_hint(cfg)
    assert "lower --micro-batch-size (now 4)" in hint and "--gradient-checkpointing" not in hint
    assert hint.endswith("or pass --offload-train and --offload-rollout")
    assert out_of_memory_hint(None).startswith("to fit: lower --max-tokens-per-gpu")
