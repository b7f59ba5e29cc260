"""Each process's device memory step by step, read from a run's metrics.jsonl: does an engine or a trainer grow?

    python bench/memory_by_step.py RUN_DIR

Prints, per step, the GPU memory of every worker process the run sampled (`sys/<worker>/gpu_mem_gb`, GiB,
after the step) and the bytes of that step's weight push (`perf/update_weights_bytes`); then, per worker, its
growth a step from its first sampled step to its last (least squares) and that growth over the push's bytes
(near 1: the worker keeps one push's worth a step). Ends with one JSON line of those figures. A CPU run
samples no GPU memory: it says so.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

WORKER_MEM = re.compile(r"^sys/(?P<worker>[^/]+_\d+)/gpu_mem_gb$")


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares growth of ys per unit of xs (0 with fewer than two points)."""
    if len(xs) < 2:
        return 0.0
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return 0.0 if var == 0 else sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var


def summarize(rows: list[dict]) -> dict:
    steps = [r for r in rows if isinstance(r.get("step"), int) and r["step"] >= 0]
    workers = sorted({m["worker"] for r in steps for k in r if (m := WORKER_MEM.match(k))})
    push = [r["perf/update_weights_bytes"] for r in steps if r.get("perf/update_weights_bytes")]
    push_gib = push[0] / 2**30 if push else None
    out: dict = {"steps": len(steps), "push_gib": push_gib, "workers": {}}
    for w in workers:
        points = [(r["step"], r[f"sys/{w}/gpu_mem_gb"]) for r in steps if f"sys/{w}/gpu_mem_gb" in r]
        growth = slope([p[0] for p in points], [p[1] for p in points])
        out["workers"][w] = {
            "first_gib": points[0][1],
            "last_gib": points[-1][1],
            "growth_gib_per_step": growth,
            "growth_over_push": None if not push_gib else growth / push_gib,
        }
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir", type=Path)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    path = a.run_dir / "metrics.jsonl"
    if not path.is_file():
        raise SystemExit(f"memory_by_step: no metrics.jsonl in {a.run_dir}; pass the run's --output-dir")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    figures = summarize(rows)
    if not figures["workers"]:
        print(f"memory_by_step: {path} samples no process's GPU memory (a CPU run?)")
    else:
        names = list(figures["workers"])
        print("step  " + "  ".join(f"{w:>12}" for w in names) + "  push GiB")
        for r in rows:
            if isinstance(r.get("step"), int) and r["step"] >= 0:
                mem = "  ".join(f"{r.get(f'sys/{w}/gpu_mem_gb', float('nan')):12.3f}" for w in names)
                print(f"{r['step']:4d}  {mem}  {r.get('perf/update_weights_bytes', 0) / 2**30:8.3f}")
        for w, f in figures["workers"].items():
            ratio = "" if f["growth_over_push"] is None else f", {f['growth_over_push']:.2f}x the push"
            print(
                f"{w}: {f['first_gib']:.2f} -> {f['last_gib']:.2f} GiB, {f['growth_gib_per_step']:+.3f} GiB a step{ratio}"
            )
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
