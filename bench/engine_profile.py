"""Where the embedded engine's decode time goes, for `bench/engine_throughput.py`: the decode graph's GPU time
per replay (`graph_step_ms`), its kernels by category under torch.profiler (`profile_graph_step`, --profile-step),
the host's waits for the device in one round (`sync_census`, --sync-debug) and one round's ops (`profile_round`).

`side` is engine_throughput's `EngineSide`: anything with `round(n_new)` and a `timeline` attribute.
"""

from __future__ import annotations

import collections
import os
from typing import Any

import torch
from trace_summary import category

from miles.engines.embedded.engine import EmbeddedEngine
from miles.engines.embedded.request import StepTime


@torch.inference_mode()
def graph_step_ms(engine: EmbeddedEngine, batch: int, context: int) -> float | None:
    """GPU time of one replay of the batch's decode graph (no host work, no sampling), from CUDA events,
    with every row at `context` keys (the roofline's mean context)."""
    graphs = engine.runner.graphs
    if graphs is None or batch not in graphs.graphs:
        return None
    graphs.positions[:batch].fill_(context - 1)
    graphs.lens[:batch].fill_(context)
    graph = graphs.graphs[batch]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(50):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 50


def sync_census(side: Any, n_new: int) -> dict:
    """One engine round of n_new tokens with torch's CUDA sync debug mode on: {"source line": times the
    host waited for the device there} (the round's own closing synchronize included), and the round's
    decode steps for scale. A line whose count is about the step count waits in every decode step."""
    import warnings

    steps: list[StepTime] = []
    side.timeline = steps
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            side.round(n_new)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            side.timeline = None
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    lines = collections.Counter(
        f"{os.path.relpath(w.filename, root)}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)
    )
    print(f"sync debug: {sum(lines.values())} host waits in one round of {len(steps)} steps")
    for line, count in lines.most_common(20):
        print(f"{count:8d}  {line}")
    return {"steps": len(steps), "waits": dict(lines.most_common(20))}


def profile_round(side: Any, n_new: int) -> None:
    """One engine round under torch.profiler: the ops and kernels that take the time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        side.round(n_new)
    sort = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=30, max_name_column_width=60))


# Kernel name patterns -> category, first match wins (Triton kernels carry their Python function's name).
KERNEL_CATEGORIES = (
    ("attention", ("attend", "attention", "flash", "fmha", "sdpa", "_attn")),
    ("rope_kv_write", ("rope", "kv_write")),
    ("norm", ("rms", "norm")),
    ("activation", ("silu", "swiglu", "act_")),
    ("fp8_quant", ("amax", "float8", "fp8", "quant", "clamp", "div")),
    ("gemm", ("gemm", "gemv", "cutlass", "nvjet", "xmma", "sm90", "cublas", "matmul", "scaled_mm", "splitk")),
    ("embedding", ("embedding", "index", "gather")),
)


def kernel_category(name: str) -> str:
    return category(name, KERNEL_CATEGORIES)


@torch.inference_mode()
def profile_graph_step(engine: EmbeddedEngine, batch: int, context: int, replays: int = 20) -> dict | None:
    """torch.profiler over `replays` replays of the batch's decode graph (every row at `context` keys):
    prints each kernel's time per step and the categories' totals; returns {category: us per step} with
    "kernels" (their sum) and "step" (the replay's wall time on the GPU, CUDA events); step - kernels is
    time with no kernel running (launch gaps, dependencies)."""
    from torch.profiler import ProfilerActivity, profile

    step_ms = graph_step_ms(engine, batch, context)  # also sets the graph's positions to `context`
    if step_ms is None:
        print("profile-step: no decode graph for this batch (CUDA graphs off, or the batch is not a bucket)")
        return None
    graph = engine.runner.graphs.graphs[batch]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    rows = []
    for event in prof.key_averages():
        us = getattr(event, "self_device_time_total", None)
        us = event.self_cuda_time_total if us is None else us
        if us > 0 and getattr(event, "device_type", None) == torch.autograd.DeviceType.CUDA:
            rows.append((us / replays, event.count / replays, event.key))
    rows.sort(reverse=True)
    totals: dict[str, float] = {}
    print(f"decode step, batch {batch}, context {context}: {step_ms * 1e3:.1f} us on the GPU per replay")
    print(f"{'us/step':>9} {'calls':>6} {'%':>6}  {'category':<14} kernel")
    for us, calls, name in rows:
        kind = kernel_category(name)
        totals[kind] = totals.get(kind, 0.0) + us
        print(f"{us:9.1f} {calls:6.0f} {100 * us / (step_ms * 1e3):6.1f}  {kind:<14} {name[:90]}")
    kernels = sum(totals.values())
    print("by category: " + ", ".join(f"{k} {v:.1f} us" for k, v in sorted(totals.items(), key=lambda kv: -kv[1])))
    print(
        f"kernels {kernels:.1f} us of {step_ms * 1e3:.1f} us: {step_ms * 1e3 - kernels:.1f} us with no kernel running"
    )
    out = {k: round(v, 1) for k, v in totals.items()}
    return out | {"kernels": round(kernels, 1), "step": round(step_ms * 1e3, 1)}
