"""bench/gpu_checks.sh runs only on a GPU host, where a stale flag or a moved test file costs a whole call:
every bench command it holds parses with that bench's own argument parser, and every test path exists."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from tests.unit.bench_modules import load_bench

REPO = Path(__file__).resolve().parents[2]
SCRIPT = (REPO / "bench" / "gpu_checks.sh").read_text()
PARSERS = {
    "fp8": "parse_args",
    "fp8_gemm": "parse_args",
    "decode_attention": "parse_args",
    "engine_throughput": "parse_args",
    "moe": "parse",
    "memory_by_step": "parse_args",
    "ipc_cycles": "parse_args",
    "elementwise_kernels": "parse_args",
    "stream_diff": "parse",
}


def bench_commands(script: str) -> list[tuple[str, list[str]]]:
    """(bench name, argv) of every `python bench/<name>.py ...` line, the group's `local shape=(...)` array
    put in place of `"${shape[@]}"`."""
    commands = []
    for body in re.split(r"\n\w+\(\) \{\n", script)[1:]:
        array = re.search(r"local shape=\((.*?)\)", body, re.S)
        shape = shlex.split(array.group(1)) if array else []
        for line in re.findall(r"python (bench/\S+\.py .*)", body):
            line = re.split(r"\s[>|]", line)[0]  # the bench's own arguments, not a redirection of its output
            words = shlex.split(line.replace('"${shape[@]}"', shlex.join(shape)))
            commands.append((Path(words[0]).stem, words[1:]))
    return commands


def test_the_script_holds_the_figure_groups_commands():
    names = [name for name, _ in bench_commands(SCRIPT)]
    assert (
        names.count("fp8") == 7
        and names.count("fp8_gemm") == 5
        and names.count("engine_throughput") == 3
        and names.count("moe") == 1
    )


@pytest.mark.parametrize("name, argv", bench_commands(SCRIPT), ids=lambda v: v if isinstance(v, str) else None)
def test_each_bench_command_parses(name, argv):
    args = getattr(load_bench(name), PARSERS[name])(argv)  # argparse exits on an unknown flag or a bad choice
    if name == "moe":  # its device defaults to CUDA where there is one; the group splits what R3 leaves
        assert args.engine_moe_rounding == "transformers" and args.trainer_dtype == "bfloat16"
    elif name == "memory_by_step":  # reads the run the group's `miles train` wrote
        assert str(args.run_dir).endswith("/offload_memory")
    else:
        assert args.device == "cuda"


def test_the_moe_group_splits_what_r3_leaves():
    runs = [load_bench("moe").parse(argv) for name, argv in bench_commands(SCRIPT) if name == "moe"]
    assert len(runs) == 1 and runs[0].engine_rescore and runs[0].trainer_residual_dtype == "float32"


def test_each_test_path_exists():
    paths = re.findall(r"tests/[\w/]+\.py", SCRIPT)
    assert len(paths) >= 15
    assert [p for p in paths if not (REPO / p).is_file()] == []


def test_each_fp8_setting_it_exports_is_one_the_engine_takes():
    from miles.engines.embedded import fp8_forms, fp8_split_k

    # the forms group serves each form that the GEMM bench timed faster than block, by the bench's own labels
    assert re.findall(r"MILES_FP8_GEMM_FORM=(\S+)", SCRIPT) == ["$form"]
    assert load_bench("fp8_gemm").fp8_forms.FORMS == fp8_forms.FORMS
    assert all(fp8_forms.parse(f) == f for f in fp8_forms.FORMS)
    assert all(fp8_split_k.parse(v) for v in re.findall(r"MILES_FP8_SPLIT_K=(\S+)", SCRIPT))


def test_the_offload_memory_run_is_one_miles_takes():
    """The group's `miles train` line: its flags load (a model big enough that one push a step would show)."""
    from miles.config.load import load_config

    line = re.search(r"miles train (.*?)\n\s*python", SCRIPT, re.S).group(1)
    line = line.replace('"$out/offload_memory"', "/tmp/offload_memory").replace('"$out/offload_model"', "/tmp/m")
    cfg = load_config(shlex.split(line.replace("\\\n", " ")))
    assert cfg.model.hf_checkpoint == "/tmp/m"  # the model the group's `miles tiny-model` line writes first
    assert '"$out/offload_model" --layers 12 --hidden 2048' in SCRIPT
    assert cfg.engine.colocate and cfg.train.offload_train and cfg.train.offload_rollout
