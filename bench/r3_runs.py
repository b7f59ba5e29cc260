"""R3 off against R3 on, side by side, from two runs' metrics.jsonl (the same recipe, with and without
--use-rollout-routing-replay).

    python bench/r3_runs.py RUN_DIR_OFF RUN_DIR_ON

Prints, for each run, the mean over all steps and over the last ten of: the train/rollout log-prob gap
and KL (what R3 is for), the routing mismatch (measured only with replay on: with it off the engine
returns no routing to compare with), the rollout reward and the last held-out reward; then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

KEYS = {
    "logprob_abs_diff": "train/train_rollout_logprob_abs_diff",
    "train_rollout_kl": "train/train_rollout_kl",
    "routing_mismatch": "train/routing_mismatch",
    "reward": "rollout/reward_mean",
}


def read_rows(run_dir: Path) -> list[dict]:
    with open(run_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def summarize(rows: list[dict], last: int = 10) -> dict[str, float | None]:
    out: dict[str, float | None] = {"steps": float(len(rows))}
    for name, key in KEYS.items():
        values = [r[key] for r in rows if key in r]
        out[name] = statistics.fmean(values) if values else None
        out[f"{name}_last{last}"] = statistics.fmean(values[-last:]) if values else None
    evals = [
        (r["step"] if "step" in r else i, v)
        for i, r in enumerate(rows)
        for k, v in r.items()
        if k.endswith("/reward_mean") and k.startswith("eval/")
    ]
    out["eval_reward_last"] = evals[-1][1] if evals else None
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_off", type=Path)
    p.add_argument("run_on", type=Path)
    a = p.parse_args(argv)
    figures = {"off": summarize(read_rows(a.run_off)), "on": summarize(read_rows(a.run_on))}
    names = list(figures["off"])
    print(f"{'':28s} {'R3 off':>12s} {'R3 on':>12s}")
    for name in names:
        cells = ["—" if figures[m][name] is None else f"{figures[m][name]:.4g}" for m in ("off", "on")]
        print(f"{name:28s} {cells[0]:>12s} {cells[1]:>12s}")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
