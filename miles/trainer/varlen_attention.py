"""Causal attention over packed rows with no padding: the trainer's `miles_varlen` attention.

In the row layout (miles.trainer.packing) a micro-batch is one row of concatenated sequences whose
position ids restart at 0. With SDPA that row would need a dense block-diagonal mask, so SDPA runs the
padded layout instead, which computes every padded position and, through `logits_to_keep`, the LM head
over every row's full column span: on a GRPO batch of the GSM job's lengths, 17.5% of the update's FLOPs
predict nothing (counted by bench/packed_rows.py, which also times both layouts).

`miles_varlen` is registered with transformers' attention interface. It reads the sequence boundaries
that `PackedInputs.attention_kwargs` passes down the model (`cu_seq_lens_q`, `max_length_q`, the names
transformers' own flash-attention path uses) and runs each sequence's causal attention:
- on CUDA in bf16/fp16, with the flash kernel torch ships (`aten._flash_attention_forward` and
  `_backward`, their variable-length form): one kernel for the whole row, grouped-query heads included;
- elsewhere (CPU, fp32), one SDPA call per sequence: the same result, used by tests and the CPU trainer
  when asked for.

`pick` chooses it when the device, dtype and model allow (`unsupported`, in the torch-free
attention_models.py the controller's start-up check reads) and a one-off check of the kernel against SDPA
passes on the device (`kernel_check`); otherwise the trainer keeps SDPA and the padded layout.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from miles.trainer.attention_models import NAME, unsupported

logger = logging.getLogger(__name__)

FLASH_DTYPES = (torch.bfloat16, torch.float16)


def boundaries(seq_lens: list[int]) -> tuple[torch.Tensor, int]:
    """(cu_seq_lens int32 [n + 1], longest length) of sequences laid end to end."""
    cu = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(seq_lens, dtype=torch.int32).cumsum(0)
    return cu, max(seq_lens)


def _boundaries_from_positions(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The boundaries of a row whose positions restart at 0 for every sequence (one host sync)."""
    pos = position_ids.reshape(-1)
    starts = torch.nonzero(pos == 0).flatten()
    ends = torch.cat([starts[1:], starts.new_tensor([pos.numel()])])
    lens = (ends - starts).tolist()
    cu, longest = boundaries(lens)
    return cu.to(pos.device), longest


# The kernel as two custom ops (opaque to torch.compile, which traces only their fake shapes) and the
# autograd formula between them. Dropout is 0, so the generator state the ops hand over is never read.
def flash_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out [T, H, d], log-sum-exp [H, T] fp32, generator state) of causal attention over packed sequences."""
    out, lse, rng, _, _ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu, cu, max_len, max_len, 0.0, True, False, scale=scale
    )
    return out, lse, rng


def flash_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    rng: torch.Tensor,
    cu: torch.Tensor,
    max_len: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of `flash_forward` (dk and dv summed over each key head's query group)."""
    unused = torch.empty(0, device=q.device)
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        grad_out.contiguous(), q, k, v, out, lse, cu, cu, max_len, max_len, 0.0, True, rng, unused, scale=scale
    )
    return dq, dk, dv


_varlen_flash_fwd = torch.library.custom_op("miles::varlen_flash_fwd", mutates_args=())(flash_forward)
_varlen_flash_bwd = torch.library.custom_op("miles::varlen_flash_bwd", mutates_args=())(flash_backward)


@_varlen_flash_fwd.register_fake
def _(q, k, v, cu, max_len, scale):
    lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    return torch.empty_like(q), lse, q.new_empty((2,), dtype=torch.uint64)


@_varlen_flash_bwd.register_fake
def _(grad_out, q, k, v, out, lse, rng, cu, max_len, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, cu, max_len, scale = inputs
    out, lse, rng = output
    ctx.save_for_backward(q, k, v, out, lse, rng, cu)
    ctx.max_len, ctx.scale = max_len, scale


def _backward(ctx, grad_out, grad_lse, grad_rng):
    q, k, v, out, lse, rng, cu = ctx.saved_tensors
    dq, dk, dv = _varlen_flash_bwd(grad_out, q, k, v, out, lse, rng, cu, ctx.max_len, ctx.scale)
    return dq, dk, dv, None, None, None


_varlen_flash_fwd.register_autograd(_backward, setup_context=_setup_context)


def flash_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int, scale: float):
    """Causal attention of the sequences [cu[i], cu[i+1]) of q [T, H, d], k, v [T, KVH, d]; -> [T, H, d]
    (torch's flash kernel, CUDA, bf16/fp16; H a multiple of KVH)."""
    return _varlen_flash_fwd(q, k, v, cu, max_len, scale)[0]


def reference_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int, scale: float
) -> torch.Tensor:
    """`flash_varlen`'s result by one causal SDPA per sequence (any device and dtype)."""
    del max_len
    bounds = cu.tolist()
    gqa = q.shape[1] != k.shape[1]
    outs = []
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        qs, ks, vs = (t[lo:hi].transpose(0, 1) for t in (q, k, v))  # [heads, len, d]
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=gqa))
    return torch.cat(outs, dim=1).transpose(0, 1)


def kernel_for(q: torch.Tensor):
    """The kernel that runs for q: flash on CUDA in bf16/fp16, the per-sequence SDPA loop otherwise."""
    return flash_varlen if q.is_cuda and q.dtype in FLASH_DTYPES else reference_varlen


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: query [B, H, T, d], key/value [B, KVH, T, d]; returns
    [B, T, H, d]. One packed row (B = 1) holds the sequences `cu_seq_lens_q` / `max_length_q` (or, when a
    caller did not pass them, those its `position_ids` restart at, read with a host sync). Several rows
    (the padded layout, which the packer also uses when every sequence has the same length) are causal
    rows, right-padded: one SDPA call."""
    if sliding_window is not None:
        raise ValueError(f"{NAME} attention does not implement sliding windows; load the model with sdpa")
    if dropout:
        raise ValueError(f"{NAME} attention does not implement attention dropout (got {dropout})")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    cu, max_len = kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q")
    if query.shape[0] > 1:
        if cu is not None:
            raise ValueError(
                f"{NAME} attention: sequence boundaries are for one packed row, got {query.shape[0]} rows"
            )
        out = F.scaled_dot_product_attention(
            query, key, value, is_causal=True, scale=scale, enable_gqa=query.shape[1] != key.shape[1]
        )
        return out.transpose(1, 2), None
    if cu is None or max_len is None:
        cu, max_len = _boundaries_from_positions(kwargs["position_ids"])
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, heads, d]
    out = kernel_for(q)(q.contiguous(), k.contiguous(), v.contiguous(), cu, max_len, scale)
    return out.unsqueeze(0), None


def register() -> None:
    """Make `attn_implementation="miles_varlen"` loadable (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, attention_forward)


def flash_ops_present() -> bool:
    """The variable-length flash ops exist in this torch with the arguments `flash_forward` and `flash_backward`
    pass."""
    try:
        fwd = str(torch.ops.aten._flash_attention_forward.default._schema)
        bwd = str(torch.ops.aten._flash_attention_backward.default._schema)
    except (AttributeError, RuntimeError):
        return False
    return "Tensor? cum_seq_q" in fwd and "float? scale" in fwd and "Tensor cum_seq_q" in bwd and "float? scale" in bwd


@functools.cache
def kernel_check(device_index: int, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> str | None:
    """Run the flash kernel forward and backward on two short sequences against per-sequence SDPA on this
    device; None when they agree, else why not (the kernel raised, or its result differs)."""
    device = torch.device("cuda", device_index)
    lens = [37, 64]
    total, scale = sum(lens), head_dim**-0.5
    try:
        gen = torch.Generator(device=device).manual_seed(0)
        cu, longest = boundaries(lens)
        cu = cu.to(device)
        shapes = ((total, heads, head_dim), (total, kv_heads, head_dim), (total, kv_heads, head_dim))
        leaves = [torch.randn(s, device=device, dtype=dtype, generator=gen).requires_grad_() for s in shapes]
        grad = torch.randn((total, heads, head_dim), device=device, dtype=dtype, generator=gen)
        out = flash_varlen(*leaves, cu, longest, scale)
        got = [out, *torch.autograd.grad(out, leaves, grad)]
        ref = [t.detach().float().requires_grad_() for t in leaves]
        ref_out = reference_varlen(*ref, cu, longest, scale)
        want = [ref_out, *torch.autograd.grad(ref_out, ref, grad.float())]
    except Exception as exc:  # noqa: BLE001 - any failure means: keep SDPA
        return f"the flash kernel failed on this device ({type(exc).__name__}: {exc})"
    for name, a, b in zip(("output", "dq", "dk", "dv"), got, want, strict=True):
        err = (a.float() - b).abs().max().item()
        if not err <= 0.05 * max(b.abs().max().item(), 1.0):
            return f"the flash kernel's {name} differs from SDPA's by {err:.3g}"
    return None


def check_on(device: torch.device, dtype: torch.dtype, config: dict) -> str | None:
    """Why the flash kernel cannot serve this model on `device` in `dtype` (None: its check passed)."""
    if not flash_ops_present():
        return f"torch {torch.__version__} lacks the variable-length flash ops"
    heads = int(config.get("num_attention_heads", 0))
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or (int(config.get("hidden_size", 0)) // max(heads, 1)))
    if heads < 1 or head_dim < 1 or kv_heads < 1 or heads % kv_heads:
        return f"unexpected attention shape (heads {heads}, kv heads {kv_heads}, head dim {head_dim})"
    index = device.index if device.index is not None else torch.cuda.current_device()
    return kernel_check(index, dtype, heads, kv_heads, head_dim)


def pick(device: torch.device, dtype: torch.dtype, config: dict, *, named: bool = False) -> tuple[bool, str]:
    """(use miles_varlen, why) for a model of this config.json trained on `device` in `dtype`.

    By default only where the flash kernel runs and passed its check. `named` (`--attn-implementation
    miles_varlen`): wherever the model allows, on CPU and in fp32 through the per-sequence SDPA loop; a model
    it cannot serve, or a kernel that fails its check, is refused (ValueError)."""
    flash = device.type == "cuda" and dtype in FLASH_DTYPES
    if not named and device.type != "cuda":
        return False, "not on CUDA"
    if not named and not flash:
        return False, f"compute dtype {dtype} (the flash kernel takes bf16 or fp16)"
    why = unsupported(config) or (check_on(device, dtype, config) if flash else None)
    if why is not None and named:
        raise ValueError(f"--attn-implementation {NAME} cannot run here: {why}; use auto or sdpa")
    if why is not None:
        return False, why
    return True, "--attn-implementation" if named else "flash kernel checked against SDPA on this device"
