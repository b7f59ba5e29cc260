"""bench/trace_summary.py: GPU time by category from a Chrome trace, overlapping streams counted once."""

from __future__ import annotations

import json

import pytest

from bench_modules import load_bench  # isort: skip

summary = load_bench("trace_summary")


def _kernel(ts: float, dur: float, name: str, cat: str = "kernel") -> dict:
    return {"ph": "X", "cat": cat, "ts": ts, "dur": dur, "name": name}


def test_categories_union_and_idle_time():
    trace = {
        "traceEvents": [
            _kernel(0, 100, "nvjet_tst_128x256_h_bz_coopA_NTN"),  # gemm
            _kernel(50, 100, "triton_per_fused__log_softmax_0"),  # overlaps the GEMM on another stream
            _kernel(200, 30, "void at::native::vectorized_elementwise_kernel<4, add>"),
            _kernel(240, 10, "Memcpy DtoD (Device -> Device)", cat="gpu_memcpy"),
            _kernel(300, 50, "void multi_tensor_apply_kernel<FusedAdamMathFunctor>"),
            _kernel(300, 40, "ncclDevKernel_AllGather_RING_LL"),
            {"ph": "X", "cat": "cpu_op", "ts": 0, "dur": 999, "name": "aten::mm"},  # not GPU time
        ]
    }
    out = summary.summarize(trace, top=3)
    assert out["gpu_events"] == 6 and out["window_ms"] == 0.35
    assert out["busy_ms"] == 0.24  # [0, 150) + [200, 230) + [240, 250) + [300, 350)
    assert out["idle_ms"] == pytest.approx(0.11)
    assert out["by_category_ms"] == {
        "gemm": 0.1,
        "compiled (triton)": 0.1,
        "optimizer": 0.05,
        "collective": 0.04,
        "elementwise": 0.03,
        "copy": 0.01,
    }
    assert [k["category"] for k in out["top_kernels"]] == ["gemm", "compiled (triton)", "optimizer"]


def test_a_trace_without_gpu_events_says_so(tmp_path, capsys):
    path = tmp_path / "cpu.pt.trace.json"
    path.write_text(json.dumps({"traceEvents": [{"ph": "X", "cat": "cpu_op", "ts": 0, "dur": 5, "name": "aten::mm"}]}))
    assert summary.main([str(path)]) == 0
    assert "no GPU kernel" in capsys.readouterr().out
