"""Where a profiled step's GPU time goes, from a worker's torch.profiler trace.

    miles train ... --profile-steps 3            # writes RUN/profile/<window>/<worker>.pt.trace.json
    python bench/trace_summary.py RUN/profile/*/trainer_0.pt.trace.json [--top 25]

Reads the Chrome trace's GPU kernel, memcpy and memset events and prints: the window (first GPU event's
start to the last one's end), the time at least one of them ran (their union: streams that overlap count
once) and the time none did; the totals by category (a kernel name's first matching pattern in
CATEGORIES: cuBLAS / CUTLASS GEMMs, attention, Triton kernels that torch.compile generated, optimizer,
softmax and other reductions, elementwise, copies, collectives); and the `--top` kernels by total time
with their call counts. Ends with one JSON line. A trace with no GPU events (a CPU run) says so.

Made for the GSM recipe's question "where does the in-loop MFU go": the trainer's trace of one step is
its update (forward, backward, optimizer) and the weight push; its files can be too large to bring back
from the GPU host, this summary is not.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

# first match wins, on the lower-cased kernel name
CATEGORIES = (
    ("collective", ("nccl", "allreduce", "all_gather", "reduce_scatter")),
    ("copy", ("memcpy", "memset", "copy_kernel", "cat_array", "catarray")),
    ("attention", ("flash", "fmha", "attention", "sdpa", "attn")),
    ("optimizer", ("adam", "multi_tensor", "foreach", "fused_adam")),
    ("gemm", ("gemm", "gemv", "cutlass", "nvjet", "xmma", "sm90_", "sm80_", "cublas", "matmul", "splitk")),
    ("compiled (triton)", ("triton_",)),
    ("softmax / reduction", ("softmax", "logsumexp", "reduce", "norm", "cross_entropy", "nll")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "where", "fill", "index", "gather", "scatter")),
)
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def category(name: str, table: tuple = CATEGORIES) -> str:
    """The first category of `table` ((name, substrings) pairs) with a substring in the lower-cased kernel
    name; "other" when none has."""
    low = name.lower()
    for cat, patterns in table:
        if any(p in low for p in patterns):
            return cat
    return "other"


def gpu_events(trace: dict) -> list[tuple[float, float, str]]:
    """(start us, duration us, name) of every GPU kernel, memcpy and memset in a Chrome trace."""
    events = trace.get("traceEvents", trace if isinstance(trace, list) else [])
    out = []
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in GPU_CATS and "dur" in e:
            out.append((float(e["ts"]), float(e["dur"]), str(e.get("name", ""))))
    return out


def busy_time(events: list[tuple[float, float, str]]) -> float:
    """The union of the events' intervals, in us."""
    busy, end = 0.0, float("-inf")
    for start, dur, _ in sorted(events):
        stop = start + dur
        if stop <= end:
            continue
        busy += stop - max(start, end)
        end = stop
    return busy


def summarize(trace: dict, top: int = 25) -> dict:
    events = gpu_events(trace)
    if not events:
        return {"gpu_events": 0}
    window = max(s + d for s, d, _ in events) - min(s for s, _, _ in events)
    busy = busy_time(events)
    by_cat: dict[str, float] = defaultdict(float)
    by_kernel: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for _, dur, name in events:
        by_cat[category(name)] += dur
        by_kernel[name][0] += dur
        by_kernel[name][1] += 1
    kernels = sorted(by_kernel.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "gpu_events": len(events),
        "window_ms": round(window / 1e3, 3),
        "busy_ms": round(busy / 1e3, 3),
        "idle_ms": round((window - busy) / 1e3, 3),
        "by_category_ms": {k: round(v / 1e3, 3) for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1])},
        "top_kernels": [
            {"name": name, "ms": round(ms / 1e3, 3), "calls": int(calls), "category": category(name)}
            for name, (ms, calls) in kernels
        ],
    }


def _short(name: str, width: int = 100) -> str:
    return re.sub(r"\s+", " ", name)[:width]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", type=Path, help="a worker's .pt.trace.json")
    p.add_argument("--top", type=int, default=25, help="kernels listed by total time")
    args = p.parse_args(argv)
    out = summarize(json.loads(args.trace.read_text()), args.top)
    if not out["gpu_events"]:
        print(f"{args.trace}: no GPU kernel, memcpy or memset events (a CPU trace?)")
        print(json.dumps(out))
        return 0
    w, b = out["window_ms"], out["busy_ms"]
    print(
        f"{args.trace}: {out['gpu_events']} GPU events over {w:.1f} ms; busy {b:.1f} ms, idle {out['idle_ms']:.1f} ms"
    )
    for cat, ms in out["by_category_ms"].items():
        print(f"  {cat:<22} {ms:10.2f} ms  {100 * ms / w:5.1f}% of the window")
    print(f"{'ms':>10} {'calls':>7}  {'category':<20} kernel")
    for k in out["top_kernels"]:
        print(f"{k['ms']:10.2f} {k['calls']:7d}  {k['category']:<20} {_short(k['name'])}")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
