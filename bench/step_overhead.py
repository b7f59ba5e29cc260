"""Controller overhead as a fraction of step time, from a real CPU run of the sync loop.

The controller records, per step, the wall time spent waiting on workers (generation through
the router, the trainer's RPCs, the weight push, saves, eval); the rest of the step —
conversion to train data, the DP split, bookkeeping, metrics — is controller overhead.
Target: median overhead ≤ 1% of the step time.

    python bench/step_overhead.py [--steps 60] [--config launch/configs/demo_cpu.yaml] [flags for miles train...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
from pathlib import Path

from miles_runs import metrics_rows, train_command

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--config", default=str(REPO / "launch" / "configs" / "demo_cpu.yaml"))
    args, extra = ap.parse_known_args()
    with tempfile.TemporaryDirectory() as tmp:
        flags = ["--config", args.config, "--num-rollout", str(args.steps), "--eval-interval", "0", *extra]
        cmd = train_command(flags, tmp)
        subprocess.run(
            cmd,
            check=True,
            cwd=REPO,
            env={"MILES_TORCH_THREADS": "1", **__import__("os").environ},
            stdout=subprocess.DEVNULL,
        )
        rows = metrics_rows(tmp)
    rows = [r for r in rows if "perf/step_time" in r][2:]  # skip warm-up steps
    frac = sorted(r["perf/controller_overhead_fraction"] for r in rows)
    overhead_ms = statistics.median(r["perf/controller_overhead"] for r in rows) * 1e3
    step_ms = statistics.median(r["perf/step_time"] for r in rows) * 1e3
    p90 = frac[int(0.9 * (len(frac) - 1))]
    median = statistics.median(frac)
    print(
        f"steps measured: {len(rows)}   median step {step_ms:.1f} ms   median controller overhead {overhead_ms:.2f} ms"
    )
    print(
        f"overhead fraction: median {median:.4f}  p90 {p90:.4f}  (target <= 0.01: {'met' if median <= 0.01 else 'missed'})"
    )
    print(
        json.dumps(
            {
                "overhead_fraction": round(median, 5),
                "overhead_fraction_p90": round(p90, 5),
                "controller_overhead_ms": round(overhead_ms, 3),
                "step_time_ms": round(step_ms, 2),
                "steps": len(rows),
            }
        )
    )


if __name__ == "__main__":
    main()
