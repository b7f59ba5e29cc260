"""The figures `bench/results/gsm.md` records, read from a run's metrics.jsonl.

    python bench/gsm_summary.py RUN_DIR [--skip-first 1]

Prints the held-out accuracy curve (greedy, `eval/gsm_orig` and `eval/gsm_heldout` by step), the
medians of the step's phases over the steps after the first `--skip-first`, the update's MFU, the
largest per-phase peak GPU memory, start-up and the first step (its warm-up: kernels built, graphs captured,
`--compile`'s compilation) and the trainer's attention (its log line: `miles_varlen`, packed rows, or SDPA over
padded rows, with the reason); ends with one JSON line holding them all.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

PHASES = {
    "step_s": "perf/step_time",
    "generate_s": "perf/rollout/generate_time",
    "train_s": "perf/train_time",
    "update_s": "perf/train/update_time",
    "update_weights_s": "perf/update_weights_time",
    "mfu": "perf/train/mfu",
    "train_tokens_per_s": "perf/train_tokens_per_s",
    "response_len": "rollout/response_len_mean",
    "truncated_frac": "rollout/truncated_frac",
    "train_rollout_logprob_abs_diff": "train/train_rollout_logprob_abs_diff",  # what --fp32-residual-connection narrows
}
EVALS = ("gsm_orig", "gsm_heldout")


def summarize(rows: list[dict], skip_first: int) -> dict:
    steps = [r for r in rows if "perf/step_time" in r]
    later = steps[skip_first:] or steps
    out: dict = {"steps": len(steps)}
    for name, key in PHASES.items():
        values = [r[key] for r in later if key in r]
        if values:
            out[name] = round(statistics.median(values), 4)
    peaks: dict[str, float] = {}
    for r in steps:
        for k, v in r.items():
            if k.startswith("perf/peak_mem_gb/"):
                phase = k.rsplit("/", 1)[-1]
                peaks[phase] = max(peaks.get(phase, 0.0), v)
    out["peak_mem_gb"] = {k: round(v, 2) for k, v in sorted(peaks.items())}
    first = next((r for r in steps if "perf/startup_time" in r), {})
    out["startup_s"] = round(first["perf/startup_time"], 1) if first else None
    if first:  # the phases, launch to the first step: the before-training eval is the user's work, not start-up
        phases = {
            k.removeprefix("perf/startup/"): round(v, 1) for k, v in first.items() if k.startswith("perf/startup/")
        }
        out["startup_phases_s"] = phases
        out["startup_without_eval_s"] = round(first["perf/startup_time"] - phases.get("eval_before_train", 0.0), 1)
    if steps:  # warm-up left out of the medians: kernels compiled, graphs captured, `--compile`'s compilation
        out["first_step_s"] = round(steps[0]["perf/step_time"], 1)
    for name in EVALS:
        key = f"eval/{name}/reward_mean"
        curve = [(int(r.get("step", r.get("rollout_id", -1))), round(r[key], 4)) for r in rows if key in r]
        if curve:
            out[f"{name}_curve"] = curve
            out[f"{name}_gain"] = round(curve[-1][1] - curve[0][1], 4)
    out["reward_first5"] = round(statistics.mean([r["rollout/reward_mean"] for r in steps[:5]] or [0.0]), 4)
    out["reward_last5"] = round(statistics.mean([r["rollout/reward_mean"] for r in steps[-5:]] or [0.0]), 4)
    return out


ATTENTION_LINE = re.compile(r"trainer attention: (.+)$", re.MULTILINE)


SETUP_LINE = re.compile(r"trainer set up in (.+)$", re.MULTILINE)


def _trainer_log_line(run_dir: Path, pattern: re.Pattern) -> str | None:
    log = run_dir / "logs" / "trainer_0.log"
    found = pattern.search(log.read_text(errors="replace")) if log.is_file() else None
    return found.group(1).strip() if found else None


def trainer_attention(run_dir: Path) -> str | None:
    """The attention the trainer chose and why, as its log's `trainer attention: ...` line says (None: not
    logged, e.g. a CPU run that took SDPA without a choice to make)."""
    return _trainer_log_line(run_dir, ATTENTION_LINE)


def trainer_setup(run_dir: Path) -> str | None:
    """Where rank 0's set-up went (its log's `trainer set up in ...` line: process group, backend import, model
    and optimizer), the largest share of `startup_phases_s["trainer_setup"]` when it is long."""
    return _trainer_log_line(run_dir, SETUP_LINE)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir")
    p.add_argument("--skip-first", type=int, default=1, help="steps left out of the medians (warm-up)")
    args = p.parse_args(argv)
    path = Path(args.run_dir) / "metrics.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    out = summarize(rows, args.skip_first)
    out["trainer_attention"] = trainer_attention(Path(args.run_dir))
    out["trainer_setup"] = trainer_setup(Path(args.run_dir))
    for name in EVALS:
        for step, acc in out.get(f"{name}_curve", []):
            print(f"{name:12s} step {step:4d}  accuracy {acc:.3f}")
    print({k: v for k, v in out.items() if not k.endswith("_curve")})
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
