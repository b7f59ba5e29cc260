"""What the kernel benches share: comma-separated integer flags, the device a Triton kernel runs on, and a CUDA
graph timer of one call per buffer (as a decode step calls a kernel once per layer)."""

from __future__ import annotations

import time

import torch

from miles.engines.embedded import triton_ops


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def kernel_device(name: str) -> tuple[torch.device, bool, torch.dtype]:
    """The device a kernel bench runs on, whether it is CUDA, and the dtype to time in (bf16 there, fp32 under
    the interpreter); exits with one line where the Triton kernels do not run."""
    device = torch.device(name)
    if not triton_ops.available(device):
        raise SystemExit(f"the Triton kernels do not run on {device} here (CUDA, or TRITON_INTERPRET=1 on CPU)")
    cuda = device.type == "cuda"
    return device, cuda, torch.bfloat16 if cuda else torch.float32


def time_us(call, buffers, replays: int, cuda: bool) -> float:
    """Microseconds per call(*args), one call per tuple of `buffers` (its caches: one per layer, as a decode step
    runs them): CUDA graphs of those calls, replayed; on CPU the calls once, timed by the host's clock."""
    if not cuda:
        start = time.perf_counter()
        for args in buffers:
            call(*args)
        return (time.perf_counter() - start) / len(buffers) * 1e6
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for args in buffers:  # warm the allocator's pool outside the capture
            call(*args)
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        for args in buffers:
            call(*args)
    graph.replay()
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) * 1e3 / (replays * len(buffers))
