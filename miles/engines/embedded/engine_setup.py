"""What an embedded engine is built from: its dtype, its model (bf16, or FP8 from either checkpoint), its KV
cache's storage dtype, the tokens each KV slot holds, the prefix pool's pages and the ids that end a request.

Every size is checked here, before anything large is allocated: a KV cache larger than the device's
memory is refused naming the most tokens that fit, and a CPU cache sized by default takes at most a
share of the available memory.
"""

from __future__ import annotations

import logging

import torch

from miles.engines.embedded import fp8
from miles.engines.embedded.checkpoint import ModelSpec
from miles.engines.embedded.fp8_checkpoint import load_fp8_model
from miles.engines.embedded.kv_cache import storage_dtype
from miles.engines.embedded.model import CausalLM
from miles.engines.embedded.prefix_cache import DEFAULT_PAGE_SIZE

logger = logging.getLogger(__name__)

# Without --max-total-tokens, a CPU engine's KV cache takes at most this share of the available memory
# (64 slots of 4096 tokens is 12 GB for a 135M-parameter model: a GPU's default, not a laptop's).
CPU_KV_MEMORY_FRACTION = 0.25


def resolve_dtype(dtype: str, config: dict, device: torch.device) -> torch.dtype:
    """The torch dtype `dtype` names; "auto": fp32 on CPU, else the checkpoint's (bf16 for an fp32 one)."""
    if dtype == "auto":
        if device.type == "cpu":
            return torch.float32  # CPU bf16 matmuls are slow and the tests need fp32 numerics
        dtype = str(config.get("dtype") or config.get("torch_dtype") or "bfloat16")
        if dtype == "float32":
            dtype = "bfloat16"
    value = getattr(torch, dtype.replace("torch.", ""), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"dtype={dtype!r} is not a torch dtype; use auto, float32, bfloat16 or float16")
    return value


def load_model(
    model_path: str,
    config: dict,
    device: torch.device,
    dtype: torch.dtype,
    quantization: str | None,
    true_on_policy: bool,
) -> tuple[CausalLM, bool]:
    """(the model, whether it serves FP8). quantization "fp8" quantizes a bf16 checkpoint per block at load;
    an FP8 checkpoint is served in FP8 without it. FP8 with true-on-policy scoring is refused."""
    if quantization not in (None, "fp8"):
        raise ValueError(f"quantization={quantization!r}: the embedded engine serves fp8 (or none)")
    fp8_checkpoint = fp8.is_fp8_config(config)  # an FP8 rollout checkpoint (fp8.py): e4m3 weights, W8A8 GEMMs
    serves_fp8 = fp8_checkpoint or quantization == "fp8"
    if serves_fp8 and true_on_policy:
        raise ValueError("--true-on-policy-mode needs the trainer's exact weights; serve a bf16 checkpoint, not FP8")
    if fp8_checkpoint:
        model = load_fp8_model(model_path, device, dtype)
    else:
        model = CausalLM.from_pretrained(model_path, device, dtype)
        if serves_fp8:
            model.quantize_fp8()
    return model, serves_fp8


def resolve_kv_dtype(kv_cache_dtype: str, model_dtype: torch.dtype, true_on_policy: bool) -> torch.dtype:
    """What the KV cache stores for SGLang's `--kv-cache-dtype` name (kv_cache.py); FP8 with true-on-policy
    scoring is refused: the engine would sample from another forward than the one the trainer scores."""
    dtype = storage_dtype(kv_cache_dtype, model_dtype)
    if true_on_policy and dtype != model_dtype:
        raise ValueError(
            f"--true-on-policy-mode samples with the trainer's exact forward; kv_cache_dtype={kv_cache_dtype!r} "
            "rounds every cached key and value to FP8: use auto"
        )
    return dtype


def slot_len(
    spec: ModelSpec, kv_dtype: torch.dtype, device: torch.device, slots: int, max_total_tokens: int | None
) -> int:
    """Tokens per KV slot: max_total_tokens / slots when given (refused below 2, or larger than the device),
    else the model's context up to 4096 (on CPU: what fits a share of the available memory). kv_dtype: what
    the cache stores (an FP8 cache takes half of a bf16 one's bytes a token)."""
    max_seq_len = min(spec.max_position_embeddings, 4096)
    if max_total_tokens is None and device.type == "cpu":
        max_seq_len = cpu_slot_len(spec, kv_dtype, slots, max_seq_len)
    if max_total_tokens is not None:
        max_seq_len = max_total_tokens // slots
        if max_seq_len < 2:
            raise ValueError(
                f"max_total_tokens={max_total_tokens} gives {max_seq_len} tokens per slot for "
                f"max_running_requests={slots}; raise max_total_tokens"
            )
        check_kv_fits(spec, kv_dtype, device, slots, max_seq_len)
    return max_seq_len


def kv_bytes_per_token(spec: ModelSpec, kv_dtype: torch.dtype) -> int:
    """Bytes of K and V a token takes in the cache, every layer, in its storage dtype."""
    return 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * kv_dtype.itemsize


def cpu_slot_len(spec: ModelSpec, kv_dtype: torch.dtype, slots: int, wanted: int) -> int:
    """Tokens per slot for a CPU cache sized by default: `wanted`, or what fits the memory share."""
    import psutil

    per_token = kv_bytes_per_token(spec, kv_dtype)
    fit = int(CPU_KV_MEMORY_FRACTION * psutil.virtual_memory().available // (slots * per_token))
    if fit >= wanted:
        return wanted
    fit = max(fit, 2)
    logger.warning(
        "KV cache on CPU: %d slots x %d tokens would exceed %.0f%% of the available memory; each slot holds %d "
        "tokens (set --max-total-tokens, or fewer --max-running-requests, to choose)",
        slots, wanted, 100 * CPU_KV_MEMORY_FRACTION, fit,
    )  # fmt: skip
    return fit


def check_kv_fits(spec: ModelSpec, kv_dtype: torch.dtype, device: torch.device, slots: int, slot_len: int) -> None:
    """Refuse (ValueError) a KV cache of `slots` x `slot_len` tokens larger than the device's memory, naming
    the most tokens that would fit: allocating it would die in the allocator (or the OOM killer) instead."""
    per_token = kv_bytes_per_token(spec, kv_dtype)
    if device.type == "cuda":
        total = torch.cuda.mem_get_info(device)[1]
        where = f"{device}'s"
    else:
        import psutil

        total, where = psutil.virtual_memory().total, "this host's"
    need = slots * slot_len * per_token
    if need > total:
        raise ValueError(
            f"max_total_tokens={slots * slot_len} needs a {need / 2**30:.1f} GiB KV cache ({per_token} bytes a token), "
            f"more than {where} {total / 2**30:.1f} GiB; at most {total // per_token} tokens fit (fewer with the "
            "weights): lower --max-total-tokens"
        )


def prefix_pages(enabled: bool, tokens: int | None, slots: int, max_seq_len: int) -> int:
    """Pages of the shared prefix pool (0: prefix sharing off); `tokens` None: a quarter of the slots' capacity."""
    if not enabled:
        return 0
    tokens = slots * max_seq_len // 4 if tokens is None else tokens
    if tokens < DEFAULT_PAGE_SIZE:
        raise ValueError(
            f"prefix_cache_tokens={tokens} holds no {DEFAULT_PAGE_SIZE}-token page; raise it or disable prefix sharing"
        )
    return tokens // DEFAULT_PAGE_SIZE


def graphs_supported(device: torch.device, spec: ModelSpec) -> bool:
    """Decode CUDA graphs work here: a CUDA device and a dense model."""
    return device.type == "cuda" and not spec.moe_layers


def eos_ids(config: dict, tokenizer) -> frozenset[int]:
    """The ids that end a request: the config's `eos_token_id` (one or a list) and the tokenizer's."""
    ids = config.get("eos_token_id")
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return frozenset(ids)
