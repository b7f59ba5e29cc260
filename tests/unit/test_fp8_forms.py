"""cuBLASLt's other block-scaled forms (fp8_forms, MILES_FP8_GEMM_FORM): each form's operands give the engine's
product, the probe keeps the first scale layout that computes it (and the block form where none does), the engine's
GEMM goes through the chosen form, and a form with no cuBLASLt GEMM to serve is refused at import. cuBLASLt's
block-scaled `torch._scaled_mm` runs only on Hopper: here a stand-in reads the scales by their shapes
(test_fp8_split_k.py); `bench/fp8_gemm.py --scale-layouts` runs the real call."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch

from miles.engines.embedded import fp8, fp8_forms
from tests.unit.test_fp8_split_k import _any_block_scaled, _operands


@pytest.fixture(autouse=True)
def _no_probe_kept(monkeypatch):
    monkeypatch.setattr(fp8_forms, "_chosen", {})
    monkeypatch.setattr(fp8_forms, "_refused_rows", set())


@pytest.mark.parametrize("form", fp8_forms.FORMS)
def test_every_layout_of_every_form_gives_the_engines_product(form):
    x, xq, xs, wq, ws = _operands(m=8, n=384, k=1024)
    want = fp8._emulated(x, fp8.Fp8Weight(wq, ws), torch.float32)
    for layout in range(fp8_forms.LAYOUTS[form]):
        got = fp8_forms.mm(form, layout, xq, xs, wq, ws, torch.float32, scaled_mm=_any_block_scaled)
        assert got.shape == (8, 384) and got.is_contiguous()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def _only(form: str, layout: int):
    """A stand-in that takes `form`'s operands at `layout` only, as a cuBLASLt reading one layout would."""

    def scaled_mm(a, b, scale_a, scale_b, out_dtype):
        ops = fp8_forms.operands(form, layout, *_probe_operands(a, b, form))
        if scale_a.stride() != ops[2].stride() or scale_b.stride() != ops[3].stride():
            raise RuntimeError("Invalid scaling configuration")
        return _any_block_scaled(a, b, scale_a, scale_b, out_dtype)

    return scaled_mm


def _probe_operands(a, b, form):
    """(xq, xs, wq, ws) placeholders shaped as the probe's, for `operands` to lay out (strides only)."""
    m, n = (b.shape[1], a.shape[0]) if form == "swapped" else (a.shape[0], b.shape[1])
    k = a.shape[1]
    xs = torch.ones(m, k // fp8.BLOCK).t().contiguous().t()
    ws = torch.ones(-(-n // fp8.BLOCK), k // fp8.BLOCK)
    return torch.empty(m, k), xs, torch.empty(n, k), ws


@pytest.mark.parametrize(("form", "layout"), [("rows", 1), ("swapped", 2), ("swapped", 3)])
def test_the_probe_keeps_the_layout_torch_computes_and_remembers_it(monkeypatch, form, layout):
    calls = []
    only = _only(form, layout)
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: calls.append(1) or only(*a, **k))
    assert fp8_forms.layout_for(torch.device("cpu"), form, fp8.form_sample) == layout
    tried = len(calls)
    assert tried == layout + 1  # the layouts before it refused, it computed
    assert (
        fp8_forms.layout_for(torch.device("cpu"), form, fp8.form_sample) == layout and len(calls) == tried
    )  # probed once
    assert fp8_forms.probed(form) == {"cpu": layout} and fp8_forms.probed("block") == {}


def test_a_form_torch_computes_wrong_leaves_the_block_form_with_a_warning(monkeypatch, caplog):
    def wrong(a, b, scale_a, scale_b, out_dtype):
        return _any_block_scaled(a, b, scale_a, scale_b, out_dtype) * 1.5  # the scales read another way

    monkeypatch.setattr(torch, "_scaled_mm", wrong)
    with caplog.at_level(logging.WARNING, logger=fp8_forms.__name__):
        assert fp8_forms.layout_for(torch.device("cpu"), "swapped", fp8.form_sample) is None
    assert "MILES_FP8_GEMM_FORM=swapped" in caplog.text and "block form serves" in caplog.text


@pytest.mark.parametrize("form", ["rows", "swapped"])
def test_the_engines_gemm_goes_through_the_form_and_back_to_block_without_one(monkeypatch, form):
    x, _, _, wq, ws = _operands(m=6, n=256, k=2048)  # 6 rows: padded to 8 for cuBLASLt, cut back after
    weight = fp8.Fp8Weight(wq, ws)
    want = fp8._emulated(x, weight, torch.float32)
    seen = []

    def scaled_mm(a, b, scale_a, scale_b, out_dtype):
        seen.append("weight as A" if a.shape[0] == 256 else "activation as A")
        return _any_block_scaled(a, b, scale_a, scale_b, out_dtype)

    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
    monkeypatch.setattr(fp8_forms, "FORM", form)
    got = fp8._block_scaled_mm(x, weight, torch.float32)
    assert got.shape == (6, 256)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert seen[-1] == ("weight as A" if form == "swapped" else "activation as A")

    monkeypatch.setattr(fp8_forms, "_chosen", {(x.device, form): None})  # torch took none of its layouts
    seen.clear()
    block = fp8._block_scaled_mm(x, weight, torch.float32)
    torch.testing.assert_close(block, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert seen == ["activation as A"]


@pytest.mark.parametrize(
    "env",
    [
        {"MILES_FP8_GEMM_FORM": "swapped", "MILES_FP8_CUDA_KERNELS": "0"},
        {"MILES_FP8_GEMM_FORM": "rows", "MILES_FP8_GEMM": "triton"},
        {"MILES_FP8_GEMM_FORM": "rows", "MILES_FP8_SPLIT_K": "auto"},
        {"MILES_FP8_GEMM_FORM": "transposed"},
    ],
)
def test_a_form_with_nothing_to_serve_or_unknown_is_refused_at_import(env):
    full = {k: v for k, v in os.environ.items() if not k.startswith("MILES_FP8_")} | env
    r = subprocess.run(
        [sys.executable, "-c", "import miles.engines.embedded.fp8"], env=full, capture_output=True, text=True
    )
    assert r.returncode != 0 and "MILES_FP8_GEMM_FORM" in r.stderr.splitlines()[-1], r.stderr[-400:]


def test_a_shape_torch_refuses_in_the_form_is_served_by_the_block_form_from_then_on(monkeypatch, caplog):
    x, _, _, wq, ws = _operands(m=4, n=256, k=2048)
    weight = fp8.Fp8Weight(wq, ws)
    seen = []

    def scaled_mm(a, b, scale_a, scale_b, out_dtype):
        swapped = a.shape[0] == 256
        seen.append(swapped)
        if swapped and b.shape[1] % 8:  # an output row of 4 bf16 values: not 16-byte aligned
            raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED")
        return _any_block_scaled(a, b, scale_a, scale_b, out_dtype)

    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
    monkeypatch.setattr(fp8_forms, "FORM", "swapped")
    monkeypatch.setattr(fp8_forms, "_chosen", {(x.device, "swapped"): 0})
    want = fp8._emulated(x, weight, torch.float32)
    with caplog.at_level(logging.WARNING, logger=fp8_forms.__name__):
        got = fp8._block_scaled_mm(x, weight, torch.float32)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert seen == [True, False] and "refused 4 rows" in caplog.text
    seen.clear()
    fp8._block_scaled_mm(x, weight, torch.float32)
    assert seen == [False]  # remembered: not tried again
