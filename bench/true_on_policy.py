"""What `--true-on-policy-mode` costs: the same run in the default mode and in the mode, side by side.

    python bench/true_on_policy.py --preset smollm2-1gpu     # one GPU: the SmolLM2 recipe, colocated
    python bench/true_on_policy.py --preset demo-cpu         # CPU: the digit-copy demo

Each repetition runs the default mode, then the mode, each one `miles train` subprocess (`--num-rollout`
steps, no eval) in its own directory, so the two share the machine's state. Per mode, over the steps
after the first of every run (the first pays start-up): the median step time, sampled tokens per
second (response tokens of a step / its step time), the median rollout and train phase times, and the
largest `train/train_rollout_logprob_abs_diff` of any step. Prints one line per mode, then one JSON
line with the figures and the cost ratios (mode / default).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import yaml
from miles_runs import metrics_rows, train_command

REPO = Path(__file__).resolve().parents[1]
PRESETS = {
    "smollm2-1gpu": ["--config", "launch/configs/smollm2_arith_gpu.yaml", "--colocate"],
    "demo-cpu": ["--config", "launch/configs/demo_cpu.yaml"],
}
MODES = {"default": [], "true_on_policy": ["--true-on-policy-mode"]}


def run_once(flags: list[str], out_dir: Path, timeout_s: float) -> list[dict]:
    cmd = train_command(flags, out_dir)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    rows = metrics_rows(out_dir)
    samples = _samples_per_step(out_dir)
    return [dict(r, samples=samples) for r in rows if "perf/step_time" in r]


def _samples_per_step(out_dir: Path) -> int:
    cfg = yaml.safe_load((out_dir / "config.yaml").read_text())
    rollout = cfg["rollout"]
    return rollout["rollout_batch_size"] * rollout["n_samples_per_prompt"]


def summarise(rows: list[dict]) -> dict:
    """Figures of one mode from the rows of its runs (first step of each run already dropped)."""
    med = lambda key: statistics.median(r[key] for r in rows)  # noqa: E731
    tokens_per_s = [r["rollout/response_len_mean"] * r["samples"] / r["perf/step_time"] for r in rows]
    return {
        "steps": len(rows),
        "step_time_s": med("perf/step_time"),
        "sampled_tokens_per_s": statistics.median(tokens_per_s),
        "rollout_time_s": med("perf/rollout/generate_time"),
        "train_time_s": med("perf/train_time"),
        "max_logprob_abs_diff": max(r["train/train_rollout_logprob_abs_diff"] for r in rows),
        "reward_last": rows[-1]["rollout/reward_mean"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="demo-cpu")
    ap.add_argument("--num-rollout", type=int, default=6, help="steps per run (the first is not counted)")
    ap.add_argument("--repeats", type=int, default=2, help="runs per mode, alternating with the other mode")
    ap.add_argument("--timeout-s", type=float, default=1800)
    ap.add_argument("--work-dir", default=None, help="where the runs write (default: a temporary directory)")
    ap.add_argument("extra", nargs="*", help="more `miles train` flags for both modes (after --)")
    args = ap.parse_args()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench-top-"))
    base = [*PRESETS[args.preset], "--num-rollout", str(args.num_rollout), "--eval-interval", "0", *args.extra]
    rows: dict[str, list[dict]] = {mode: [] for mode in MODES}
    start = time.perf_counter()
    for rep in range(args.repeats):
        for mode, flags in MODES.items():
            got = run_once([*base, *flags], work / f"{mode}_{rep}", args.timeout_s)
            rows[mode] += got[1:]
            print(
                f"rep {rep} {mode}: {len(got)} steps, step times {[round(r['perf/step_time'], 2) for r in got]}",
                flush=True,
            )
    figures = {mode: summarise(r) for mode, r in rows.items()}
    for mode, f in figures.items():
        print(
            f"{mode:>15}: step {f['step_time_s']:.3f} s  sampled {f['sampled_tokens_per_s']:.0f} tok/s  "
            f"rollout {f['rollout_time_s']:.3f} s  train {f['train_time_s']:.3f} s  "
            f"max |train - rollout log-prob| {f['max_logprob_abs_diff']:.3g}"
        )
    d, t = figures["default"], figures["true_on_policy"]
    result = {
        "bench": "true_on_policy",
        "preset": args.preset,
        "flags": base,
        "repeats": args.repeats,
        "default": d,
        "true_on_policy": t,
        "step_time_ratio": t["step_time_s"] / d["step_time_s"],
        "throughput_ratio": t["sampled_tokens_per_s"] / d["sampled_tokens_per_s"],
        "rollout_time_ratio": t["rollout_time_s"] / d["rollout_time_s"],
        "train_time_ratio": t["train_time_s"] / d["train_time_s"],
        "wall_s": time.perf_counter() - start,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
