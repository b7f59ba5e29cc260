"""The GPU matrix: each layout a user runs, as one `miles train` command, with what it learned.

    python bench/gpu_matrix.py --list
    python bench/gpu_matrix.py --runs colocate_1gpu disagg_1p1 --out bench/results/gpu_matrix.jsonl
    python bench/gpu_matrix.py --group core --parallel 3

Each run is a subprocess `miles train` (the same command a user types; it is printed with the
result) in its own output directory. A run is `ok` when the command exits 0, every step of
`--num-rollout` is in its metrics, and its learning check holds: the demo's rollout reward rises
(mean of the last 5 steps above the first step's), the SmolLM2 recipe's held-out reward rises by at
least `--min-heldout-gain` from before training to its best evaluation. Runs that only probe
stability (long answers) need the steps alone.

One JSON line per run: run, gpus, ok, reward_first, reward_last, step_time_s (median of the steps
after the first), startup_s (launch to the end of the first step), command, and the held-out
rewards where the run evaluates. `--parallel N` runs up to N commands at once when they fit the
GPUs side by side (small models; their step times then include the sharing, which the line says).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from miles_runs import metrics_rows, train_command

REPO = Path(__file__).resolve().parents[1]
DEMO = ["--config", "launch/configs/demo_cpu.yaml", "--eval-interval", "0", "--num-rollout", "40"]
SMOLLM2 = ["--config", "launch/configs/smollm2_arith_gpu.yaml"]
CALCULATOR = ["--config", "launch/configs/smollm2_calculator_gpu.yaml"]


@dataclass(slots=True)
class Run:
    name: str
    gpus: int
    flags: list[str]
    group: str  # core | crash | smollm2 | precision | agentic | megatron
    learns: str = "rollout"  # rollout | heldout | none (stability only)
    long_answers: bool = False  # every prompt forces 512 new tokens (ignore_eos)
    env: dict[str, str] = field(default_factory=dict)


def _runs() -> list[Run]:
    """Every run of the matrix, in the order a whole-matrix call takes them."""
    return [*_demo_runs(), *_smollm2_runs(), *_megatron_runs(), *_pause_runs()]


def _demo_runs() -> list[Run]:
    """The demo job on each placement and weight transport (the core runs)."""
    return [
        Run("colocate_1gpu", 1, [*DEMO, "--colocate"], "core"),
        Run("disagg_1p1", 2, DEMO, "core"),
        Run("async_1p1", 2, [*DEMO, "--fully-async"], "core"),
        Run("colocate_2trainers", 2, [*DEMO, "--colocate", "--actor-num-gpus-per-node", "2"], "core"),
        Run("p2p_1p1", 2, [*DEMO, "--update-weight-transfer-mode", "p2p"], "core"),
        Run(
            "disk_delta_1p1",
            2,
            [*DEMO, "--update-weight-transfer-mode", "disk-delta", "--update-weight-disk-dir", "{work}/disk_delta"],
            "core",
        ),
    ]


def _smollm2_runs() -> list[Run]:
    """SmolLM2: learning on both placements, the tool-calling job, checkpoint precisions, long answers."""
    return [
        Run("smollm2_colocate", 1, [*SMOLLM2, "--colocate"], "smollm2", learns="heldout"),
        Run("smollm2_disagg", 2, SMOLLM2, "smollm2", learns="heldout"),
        # multi-turn with a tool through the session server; the rollout reward (last 5 steps vs the first) rises
        Run("smollm2_calculator_colocate", 1, [*CALCULATOR, "--colocate"], "agentic"),
        Run(
            "smollm2_bf16ckpt_colocate",
            1,
            [*SMOLLM2, "--colocate", "--hf-checkpoint", "smollm2:bfloat16"],
            "precision",
            learns="none",
        ),
        Run(
            "smollm2_bf16ckpt_fp32_colocate",
            1,
            [*SMOLLM2, "--colocate", "--hf-checkpoint", "smollm2:bfloat16", "--dtype", "float32"],
            "precision",
            learns="none",
        ),
        Run(
            "smollm2_colocate_long",
            1,
            [
                *SMOLLM2,
                "--colocate",
                "--num-rollout",
                "10",
                "--eval-interval",
                "0",
                "--rollout-max-response-len",
                "512",
            ],
            "crash",
            learns="none",
            long_answers=True,
        ),
    ]


def _megatron_runs() -> list[Run]:
    """The megatron trainer: colocated, tensor-parallel, and each weight transport to a separate engine."""
    megatron = [*DEMO, "--colocate", "--train-backend", "megatron"]
    return [
        Run("megatron_colocate_1gpu", 1, megatron, "megatron"),
        # two tensor-parallel ranks gather their shards for the engine, whose every tensor is checked
        Run(
            "megatron_tp2_colocate",
            2,
            [
                *megatron,
                "--actor-num-gpus-per-node",
                "2",
                "--tensor-model-parallel-size",
                "2",
                "--check-weight-update-equal",
            ],
            "megatron",
        ),  # fmt: skip
        # disaggregated (one trainer GPU, one engine GPU): each weight transport from the megatron trainer,
        # every engine tensor checked against the trainer's
        *(
            Run(
                f"megatron_{name}_1p1",
                2,
                [*DEMO, "--train-backend", "megatron", "--check-weight-update-equal", *flags],
                "megatron",
            )
            for name, flags in (
                ("broadcast", []),
                ("p2p", ["--update-weight-transfer-mode", "p2p"]),
                (
                    "disk_delta",
                    [
                        "--update-weight-transfer-mode",
                        "disk-delta",
                        "--update-weight-disk-dir",
                        "{work}/disk_delta_megatron",
                    ],
                ),
            )
        ),
        Run(
            "smollm2_megatron_colocate",
            1,
            [*SMOLLM2, "--colocate", "--train-backend", "megatron"],
            "megatron",
            learns="heldout",
        ),  # fmt: skip
    ]


def _pause_runs() -> list[Run]:
    """Each way of pausing generation for a weight update, with and without CUDA graphs."""
    runs = []
    for mode in ("retract", "in_place", "abort"):
        for graphs in (True, False):
            flags = [*DEMO, "--pause-generation-mode", mode]
            if not graphs:
                flags.append("--sglang-disable-cuda-graph")
            runs.append(Run(f"disagg_{mode}_{'graphs' if graphs else 'eager'}", 2, flags, "crash"))
    return runs


RUNS = {r.name: r for r in _runs()}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", nargs="*", default=[], help=f"runs by name: {', '.join(RUNS)}")
    p.add_argument(
        "--group",
        nargs="*",
        default=[],
        help="every run of these groups: core, crash, smollm2, precision, agentic, megatron",
    )
    p.add_argument("--list", action="store_true", help="print the runs and their commands, run nothing")
    p.add_argument("--parallel", type=int, default=1, help="commands at once (their GPUs are shared)")
    p.add_argument("--timeout-s", type=float, default=900.0, help="per run")
    p.add_argument("--min-heldout-gain", type=float, default=0.3)
    p.add_argument("--work-dir", default=None, help="run directories (default: a temporary folder)")
    p.add_argument("--out", default=None, help="append the JSON lines to this file too")
    p.add_argument("--extra", default="", help="flags added to every run's command (one shell-quoted string)")
    p.add_argument("--tag", default="", help="suffix of every run's name in the results (e.g. a variant)")
    return p.parse_args(argv)


def _long_answer_data(work: Path) -> Path:
    """The recipe's prompts, each asking for exactly 512 new tokens (ignore_eos)."""
    out = work / "arith_train_512.jsonl"
    with open(REPO / "launch/data/arith_train.jsonl") as src, out.open("w") as dst:
        for line in src:
            row = json.loads(line)
            row["metadata"] = {"sampling_params": {"max_new_tokens": 512, "ignore_eos": True}}
            dst.write(json.dumps(row) + "\n")
    return out


def command(run: Run, out_dir: Path, work: Path, extra: list[str]) -> list[str]:
    flags = [f.replace("{work}", str(work)) for f in run.flags]
    cmd = train_command(flags, out_dir)
    if run.long_answers:
        cmd += ["--prompt-data", str(_long_answer_data(work)), "--rollout-stop"]
    return cmd + extra


def summarise(
    run: Run,
    out_dir: Path,
    rc: int | None,
    wall_s: float,
    cmd: list[str],
    min_gain: float,
    parallel: int,
    tag: str = "",
) -> dict:
    rows = [r for r in metrics_rows(out_dir) if "rollout/reward_mean" in r]
    rewards = [r["rollout/reward_mean"] for r in rows]
    steps = [r["perf/step_time"] for r in rows if "perf/step_time" in r]
    heldout = [r[k] for r in metrics_rows(out_dir) for k in r if k.startswith("eval/") and k.endswith("/reward_mean")]
    expected = _num_rollout(out_dir)
    line = {
        "run": run.name + tag,
        "gpus": run.gpus,
        "ok": False,
        "reward_first": rewards[0] if rewards else None,
        "reward_last": rewards[-1] if rewards else None,
        "reward_last5": statistics.fmean(rewards[-5:]) if rewards else None,
        "step_time_s": statistics.median(steps[1:]) if len(steps) > 1 else (steps[0] if steps else None),
        "startup_s": round(wall_s - sum(steps[1:]), 1) if steps else None,
        "steps": len(rewards),
        "rc": rc,
        "command": shlex.join(["miles", *cmd[3:]]),
    }
    last = metrics_rows(out_dir)[-1:] or [{}]
    line["sys_gpu_metrics"] = sorted(k for k in last[0] if k.startswith("sys/gpu"))
    if heldout:
        line["heldout_first"], line["heldout_best"], line["heldout_last"] = heldout[0], max(heldout), heldout[-1]
    if parallel > 1:
        line["shared_gpus_with"] = parallel - 1
    learned = {
        "rollout": bool(rewards) and line["reward_last5"] > rewards[0],
        "heldout": bool(heldout) and max(heldout) - heldout[0] >= min_gain,
        "none": True,
    }[run.learns]
    line["ok"] = rc == 0 and expected is not None and len(rewards) == expected and learned
    return line


def _num_rollout(out_dir: Path) -> int | None:
    import yaml

    path = out_dir / "config.yaml"
    if not path.exists():
        return None
    return yaml.safe_load(path.read_text())["rollout"]["num_rollout"]


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    chosen = [RUNS[n] for n in args.runs] + [
        r for r in RUNS.values() if r.group in args.group and r.name not in args.runs
    ]
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="gpu-matrix-"))
    work.mkdir(parents=True, exist_ok=True)
    extra = shlex.split(args.extra)
    if args.list or not chosen:
        for run in chosen or RUNS.values():
            print(
                f"{run.name:24s} {run.gpus} GPU  {shlex.join(['miles', *command(run, work / run.name, work, extra)[3:]])}"
            )
        return 0
    have = _gpu_count()
    pending, active, lines = list(chosen), [], []
    while pending or active:
        while pending and len(active) < args.parallel:
            run = pending.pop(0)
            if run.gpus > have:
                lines.append(
                    _emit(
                        {
                            "run": run.name,
                            "gpus": run.gpus,
                            "ok": False,
                            "skipped": f"needs {run.gpus} GPUs, have {have}",
                        },
                        args.out,
                    )
                )
                continue
            out_dir = work / run.name
            cmd = command(run, out_dir, work, extra)
            log = open(work / f"{run.name}.log", "w")  # noqa: SIM115 - closed when the run ends
            env = {**os.environ, **run.env}
            proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
            active.append((run, proc, out_dir, cmd, time.perf_counter(), log))
        time.sleep(0.5)
        for item in list(active):
            run, proc, out_dir, cmd, start, log = item
            rc = proc.poll()
            if rc is None and time.perf_counter() - start < args.timeout_s:
                continue
            if rc is None:
                proc.kill()
                rc = proc.wait()
            log.close()
            active.remove(item)
            line = summarise(
                run, out_dir, rc, time.perf_counter() - start, cmd, args.min_heldout_gain, args.parallel, args.tag
            )
            if not line["ok"]:
                line["log_tail"] = (work / f"{run.name}.log").read_text()[-1500:]
            lines.append(_emit(line, args.out))
    print(
        json.dumps(
            {
                "runs": len(lines),
                "ok": sum(bool(x.get("ok")) for x in lines),
                "failed": [x["run"] for x in lines if not x.get("ok")],
            }
        )
    )
    return 0 if all(x.get("ok") for x in lines) else 1


def _emit(line: dict, out: str | None) -> dict:
    text = json.dumps(line)
    print(text, flush=True)
    if out:
        with open(out, "a") as f:
            f.write(text + "\n")
    return line


if __name__ == "__main__":
    sys.exit(main())
