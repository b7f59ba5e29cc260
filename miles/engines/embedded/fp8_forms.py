"""cuBLASLt's other block-scaled forms for the engine's FP8 GEMMs (MILES_FP8_GEMM_FORM).

The engine's GEMM (`fp8._block_scaled_mm`) hands `torch._scaled_mm` the activation as A, in 1x128 groups, and the
weight as B, in 128x128 blocks ("block"). On Hopper torch takes the same codes and scales in two more forms, each
the same W8A8 product up to the order of its fp32 sums:
- "rows": both operands in 1x128 groups, each weight block's scale repeated over its 128 rows (a small kernel a
  call: a push rewrites the scales in place, so no repeated copy is kept);
- "swapped": the weight as A (128x128 blocks) and the activation as B (1x128 groups), computing out^T [N, M]. It
  hands cuBLASLt the large dimension as M where a decode batch (256 rows) leaves few output tiles, as small-M FP8
  GEMM libraries do; the output is copied back to [M, N] for the kernels that read it.

torch does not write down which memory layout of each scale operand cuBLASLt reads in these two forms. The first
call on a device (eager: the engine warms every graph up before capturing it) tries each candidate layout on a
small product against its dequantized value and keeps the first that computes it; where none does, the block form
serves and a warning says why. `bench/fp8_gemm.py --scale-layouts` times every form on a 7B layer's GEMMs.

MILES_FP8_GEMM_FORM: block (the default), rows or swapped; with the CUDA kernels off, the Triton GEMM or split-K
it is refused at import (fp8.py).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch

from miles.engines.embedded.fp8_split_k import BLOCK

logger = logging.getLogger(__name__)

FORMS = ("block", "rows", "swapped")
# the candidate layouts of each form's scale operands, tried in this order (see `operands`)
LAYOUTS = {"block": 1, "rows": 2, "swapped": 4}


def parse(text: str) -> str:
    if text not in FORMS:
        raise ValueError(f"MILES_FP8_GEMM_FORM={text!r}: use one of {', '.join(FORMS)} (block is the default)")
    return text


FORM = parse(os.environ.get("MILES_FP8_GEMM_FORM", "block"))

# (device, form) -> the layout that computed the probe's product, or None: torch took none (the block form serves)
_chosen: dict[tuple[torch.device, str], int | None] = {}
# (device, rows) whose product torch refused in FORM: the block form serves those
_refused_rows: set[tuple[torch.device, int]] = set()


def cublas_weight_scales(scale_inv: torch.Tensor) -> torch.Tensor:
    """`scale_b` of torch._scaled_mm for a 128x128-scaled weight [N, K] whose block scales are scale_inv
    [NB, L] (L = K/128, a multiple of 4: see fp8.pad_k_blocks): the [L, NB] transpose, K-block-major."""
    return scale_inv.contiguous().t()


def operands(
    form: str, layout: int, xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """(A, B, scale_a, scale_b, transposed) of `form` at candidate `layout` for x [M, K] @ w [N, K]^T: xq [M, K]
    e4m3 with xs [M, L] outer-dim-major (as the engine keeps it), wq [N, K] e4m3 with its block scales ws [NB, L].
    transposed: the product comes out [N, M]."""
    if form == "block":
        return xq, wq.t(), xs, cublas_weight_scales(ws), False
    # each layout is built alone: a copy made for a layout not taken would be a kernel of every call
    if form == "rows":  # [L, N]: each output row's own copy of its block's scales, K-major then N-major
        rows = ws.repeat_interleave(BLOCK, 0)[: wq.shape[0]].t()
        return xq, wq.t(), xs, rows.contiguous() if layout else rows, False
    if form == "swapped":
        scale_a = ws.t().contiguous().t() if layout // 2 else ws.contiguous()
        scale_b = xs.contiguous().t() if layout % 2 else xs.t()  # [L, M]: M-major, then L-major
        return wq, xq.t(), scale_a, scale_b, True
    raise ValueError(f"unknown FP8 GEMM form {form!r}")


def mm(
    form: str,
    layout: int,
    xq: torch.Tensor,
    xs: torch.Tensor,
    wq: torch.Tensor,
    ws: torch.Tensor,
    dtype: torch.dtype,
    scaled_mm: Callable | None = None,
) -> torch.Tensor:
    """The W8A8 product [M, N] in `dtype` through `form` at `layout` (scaled_mm: torch._scaled_mm unless given)."""
    a, b, scale_a, scale_b, transposed = operands(form, layout, xq, xs, wq, ws)
    out = (scaled_mm or torch._scaled_mm)(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=dtype)
    return out.t().contiguous() if transposed else out


# (device) -> (xq, xs, wq, ws, want): a small product's operands, as the engine lays them out, and its fp32 value
Sample = Callable[[torch.device], tuple[torch.Tensor, ...]]


def serve(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, dtype: torch.dtype, sample: Sample):
    """The product [M, N] through FORM, or None where the block form should serve it: FORM is block, its probe
    (on `sample`'s product) found no layout, or torch refused this shape (e.g. a row count its output's alignment
    does not take: remembered per row count, and logged once)."""
    if FORM == "block":
        return None
    device, rows = xq.device, xq.shape[0]
    layout = layout_for(device, FORM, sample)
    if layout is None or (device, rows) in _refused_rows:
        return None
    try:
        return mm(FORM, layout, xq, xs, wq, ws, dtype)
    except (RuntimeError, ValueError, NotImplementedError) as e:
        _refused_rows.add((device, rows))
        logger.warning(
            "MILES_FP8_GEMM_FORM=%s: torch._scaled_mm refused %d rows (%s); the block form serves them",
            FORM,
            rows,
            str(e).splitlines()[0][:160],
        )
        return None


def layout_for(device: torch.device, form: str, sample: Sample) -> int | None:
    """The layout of `form` that computes `sample`'s product right on `device` (probed once, then remembered);
    None where torch takes none of them, or while a CUDA graph is being captured before any probe ran (nothing can
    be checked there: the block form serves that call)."""
    key = (device, form)
    if key not in _chosen:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        _chosen[key] = _probe(device, form, sample)
    return _chosen[key]


def probed(form: str) -> dict[str, int | None]:
    """Device name -> the layout of `form` its probe kept (None: the block form serves there), for reports."""
    return {str(device): layout for (device, f), layout in _chosen.items() if f == form}


def first_layout(
    form: str, xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, want: torch.Tensor
) -> tuple[int | None, list[str]]:
    """The first candidate layout of `form` whose product (fp32, its first want.shape[0] rows) is within 1% of
    `want`'s largest value, or None; and why each layout tried before it was not taken."""
    why = []
    for layout in range(LAYOUTS[form]):
        try:
            got = mm(form, layout, xq, xs, wq, ws, torch.float32)[: want.shape[0]]
        except (RuntimeError, ValueError, NotImplementedError) as e:
            why.append(f"layout {layout}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
            continue
        rel = ((got - want).abs().max() / want.abs().max()).item()
        if rel < 1e-2:
            return layout, why
        why.append(f"layout {layout}: off by {rel:.3g} of the product's largest value")
    return None, why


def _probe(device: torch.device, form: str, sample: Sample) -> int | None:
    layout, why = first_layout(form, *sample(device))
    if layout is not None:
        logger.info("MILES_FP8_GEMM_FORM=%s: torch._scaled_mm computes it with scale layout %d", form, layout)
        return layout
    logger.warning(
        "MILES_FP8_GEMM_FORM=%s: torch._scaled_mm computed none of its scale layouts right on %s (%s); the block "
        "form serves",
        form,
        device,
        "; ".join(why),
    )
    return None
