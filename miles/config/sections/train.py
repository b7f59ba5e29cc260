"""The `train` section: the trainer: backend and layout, optimizer, batching, checkpoints, offload, LoRA."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from miles.config.option import MAX_SAMPLES_PER_STEP, SEED_RANGE, option


@dataclass
class TrainConfig:
    """The trainer: backend and layout, optimizer, batching, checkpoints, offload, LoRA."""

    train_backend: Literal["fsdp", "megatron"] = option("fsdp", "{choices}")
    lr: float = option(
        1e-6,
        "learning rate",
        range="[0, inf)",
        unit="a negative learning rate climbs the loss; typical values are 1e-6 to 1e-5",
    )
    min_lr: float = option(
        0.0, "floor of the decay schedule", range="[0, inf)", unit="the floor of the decay schedule"
    )
    lr_decay_style: Literal["constant", "linear", "cosine"] = option("constant", "{choices}")
    lr_warmup_iters: int = option(0, "warm-up optimizer steps", range="[0, inf)", unit="optimizer steps")
    lr_decay_iters: int | None = option(
        None, "decay horizon in optimizer steps (default: whole run)", range="[1, inf)", unit="optimizer steps"
    )
    weight_decay: float = option(0.0, "AdamW weight decay", range="[0, inf)", unit="AdamW's decoupled decay")
    adam_beta1: float = option(0.9, "AdamW beta1", range="[0, 1)", unit="a moving-average factor, e.g. 0.9")
    adam_beta2: float = option(0.95, "AdamW beta2", range="[0, 1)", unit="a moving-average factor, e.g. 0.95")
    adam_eps: float = option(1e-8, "AdamW epsilon", range="(0, inf)", unit="e.g. 1e-8")
    clip_grad: float = option(
        1.0, "max global grad norm (0: off)", range="[0, inf)", unit="the max grad norm; 0 turns clipping off"
    )
    seed: int = option(1234, "training seed", range=SEED_RANGE, unit="a seed")
    micro_batch_size: int = option(
        1, "samples per micro-batch without dynamic batching", range=f"[1, {MAX_SAMPLES_PER_STEP}]", unit="samples"
    )
    use_dynamic_batch_size: bool = option(False, "pack micro-batches up to --max-tokens-per-gpu")
    max_tokens_per_gpu: int | None = option(
        None, "token budget of one packed micro-batch", range="[1, inf)", unit="tokens"
    )
    gradient_checkpointing: bool = option(False, "activation checkpointing")
    compile: bool = option(
        False, "torch.compile each transformer block (fewer kernel launches; the first steps pay the compile)"
    )
    attn_implementation: Literal["auto", "miles_varlen", "sdpa", "flash_attention_2", "eager"] = option(
        "auto",
        "FSDP trainer's attention; auto: varlen attention over packed rows where a kernel runs (flash-attn's, "
        "else torch's flash kernel as miles_varlen, checked against SDPA on the device), SDPA over padded rows "
        "elsewhere; miles_varlen on CPU or in fp32 runs one SDPA call per sequence; {choices}",
    )
    fp32_residual_connection: bool = option(
        False,
        "FSDP trainer computing in bf16/fp16: keep the decoder's residual stream in fp32, as the embedded engine "
        "does (every norm and GEMM still reads compute-dtype inputs), so the trainer's log-probs follow the "
        "engine's arithmetic (Qwen2, Qwen3, Qwen3-MoE, Llama, Mistral); SGLang keeps its stream in the model "
        "dtype, so beside --engine sglang the flag moves the trainer away from it; the megatron backend's stream "
        "is fp32 always (autocast over fp32 parameters)",
    )
    fp8_format: Literal["e4m3"] | None = option(
        None,
        "FSDP trainer: its decoder projections compute as the FP8 rollout's GEMMs do (e4m3, the engine's own "
        "quantizer: 128x128 weight blocks, 1x128 activation groups, fp32 sums), with a straight-through backward "
        "in the compute dtype; the forward contract of FP8 rollouts, not FP8 speed; needs FP8 serving "
        "(--sglang-quantization fp8 or an FP8 checkpoint)",
    )
    fp8_recipe: Literal["blockwise"] = option("blockwise", "scaling of --fp8-format: {choices}")
    true_on_policy_mode: bool = option(
        False,
        "engine and trainer give bit-identical log-probs for every sampled token: both score with one reference "
        "forward (HF, eager attention, one sequence at a time, deterministic kernels); the engine re-scores each "
        "sample by prefill; costs throughput",
    )
    # ---- mixture-of-experts routing replay (docs/moe.md) ----
    use_routing_replay: bool = option(
        False,
        "MoE: the training passes replay the experts the trainer's own router chose in its first (old log-prob) "
        "forward of the step, so the policy ratio compares the same experts",
    )
    use_rollout_routing_replay: bool = option(
        False,
        "MoE (R3): the engines return the experts they routed every token to, and the trainer's forward uses "
        "them in place of its router's top-k (weights still from its router); implies --use-routing-replay",
    )
    actor_num_nodes: int = option(1, "trainer nodes", range="[1, 4096]", unit="nodes")
    actor_num_gpus_per_node: int = option(
        1, "trainer ranks per node (processes on CPU)", range="[1, 1024]", unit="ranks per node"
    )
    tensor_model_parallel_size: int = option(
        1,
        "megatron: tensor-parallel size (divides the KV heads); data-parallel size = trainer GPUs / (TP x PP x CP)",
        range="[1, 1024]",
        unit="ranks",
    )
    pipeline_model_parallel_size: int = option(
        1, "megatron: pipeline stages (divides the layers)", range="[1, 1024]", unit="stages"
    )
    expert_model_parallel_size: int = option(
        1,
        "megatron, MoE: expert-parallel size (divides the expert count and the trainer GPUs / PP); each rank holds "
        "experts / EP of every MoE layer, tokens reach them through an all-to-all",
        range="[1, 1024]",
        unit="ranks",
    )
    expert_tensor_parallel_size: int = option(
        1,
        "megatron, MoE: tensor-parallel size of each expert's MLP (divides moe_intermediate_size)",
        range="[1, 1024]",
        unit="ranks",
    )
    context_parallel_size: int = option(
        1,
        "megatron: context-parallel size (only 1: context parallelism needs Transformer Engine attention)",
        range="[1, 1024]",
        unit="ranks",
    )
    sequence_parallel: bool = option(
        False, "megatron: shard activations along the sequence over tensor-parallel ranks (needs TP > 1)"
    )
    critic_lr: float | None = option(
        None, "critic learning rate (default lr)", range="[0, inf)", unit="the critic's learning rate"
    )
    num_critic_only_steps: int = option(0, "critic warm-up steps", range="[0, inf)", unit="steps")
    load: str | None = option(None, "checkpoint directory to resume from")
    save: str | None = option(None, "checkpoint directory")
    save_interval: int | None = option(None, "save every N rollout steps", range="[1, inf)", unit="rollout steps")
    save_hf: str | None = option(None, "HF export directory template, may contain {rollout_id}")
    max_checkpoints: int | None = option(
        None,
        "keep the newest N complete checkpoints under --save, deleting older ones after each save (default: keep all)",
        range="[1, inf)",
        unit="complete checkpoints kept under --save; leave it unset to keep all",
    )
    auto_resume: bool = option(False, "resume from the latest complete checkpoint under --save")
    overwrite_save: bool = option(
        False,
        "start a fresh run into a --save that holds another run's checkpoints: its iter_* entries are deleted at "
        "start-up (without it such a --save is refused unless --load or --auto-resume resumes from it)",
    )
    no_save_optim: bool = option(False, "do not save optimizer state")
    offload_train: bool | None = option(
        None,
        "offload trainer state while engines generate (default, colocated: on unless the trainer fits beside the engines on each GPU, measured at start-up; off on CPU, where it would free nothing)",
    )
    offload_rollout: bool | None = option(
        None, "colocated engines release memory while the trainer trains (default: as --offload-train)"
    )
    offload_rollout_level: list[str] = option(
        ["kv_cache", "weight"], "what colocated engines release: kv_cache, weight, cuda_graph", nargs="+"
    )
    # ---- memory levers: optimizer state off the GPU, trainer state on disk, asynchronous saves ----
    optimizer_cpu_offload: bool = option(
        False,
        "FSDP, one trainer rank: fp32 master weights and AdamW moments live in host memory and the optimizer "
        "steps there; the GPU keeps the weights in the compute dtype and fp32 gradients, copied out per bucket",
    )
    offload_optimizer_states: bool = option(
        False,
        "FSDP, one trainer rank: AdamW moments live in pinned host memory between steps and are streamed "
        "through the GPU bucket by bucket during the step (bit-identical to resident moments)",
    )
    stream_optimizer_state_to_disk: bool = option(
        False,
        "FSDP, one trainer rank: AdamW moments live in files under --offload-train-disk-dir and are streamed "
        "through the GPU bucket by bucket during the step (fp32: bit-identical to resident moments)",
    )
    stream_optimizer_state_moment_dtype: Literal["fp32", "bf16"] = option(
        "fp32", "dtype of the moments --stream-optimizer-state-to-disk keeps on disk: {choices}"
    )
    offload_train_target: Literal["cpu", "disk"] = option(
        "cpu", "where --offload-train moves the trainer's state while engines generate: {choices}"
    )
    offload_train_disk_dir: str | None = option(
        None, "directory for --offload-train-target disk and --stream-optimizer-state-to-disk files"
    )
    offload_train_disk_chunk_mb: int = option(
        256,
        "bytes per host-to-disk copy (and per optimizer bucket), MiB",
        range="[1, 65536]",
        unit="MiB per host-to-disk copy and optimizer bucket",
    )
    async_save: bool | None = option(
        None,
        "write checkpoints in the background while the next step runs (default: on with --train-backend fsdp; "
        "--no-async-save saves synchronously)",
    )
    lora_rank: int = option(
        0,
        "LoRA rank; 0 trains every parameter, > 0 trains only a low-rank adapter on the policy (needs the lora extra: pip install 'miles[lora]')",
        range="[0, 65536]",
        unit="0 trains every parameter",
    )
    lora_alpha: int = option(
        16,
        "LoRA alpha: the adapter's update is scaled by lora_alpha / lora_rank",
        range="[1, inf)",
        unit="the adapter's scale numerator",
    )
    lora_dropout: float = option(
        0.0,
        "dropout on the adapter's input while training (the engines apply none)",
        range="[0, 1)",
        unit="a probability",
    )
    lora_merged_forward: bool = option(
        False,
        "LoRA: the adapted layers compute with the merged weight the embedded engine serves (W0 + alpha/r * B A "
        "summed in fp32, rounded to the compute dtype) instead of W0 x + alpha/r * B A x, so the trainer's "
        "log-probs follow the engine's (with --fp32-residual-connection, exactly); the backward forms each adapted "
        "weight's full gradient, as full fine-tuning does; needs --lora-dropout 0",
    )
    target_modules: str | None = option(
        None,
        "modules that get an adapter: all-linear (default: every linear layer of the decoder, not lm_head) or comma-separated module names, e.g. q_proj,v_proj",
    )

    def derive(self) -> None:
        """The values this section derives from its own flags (an explicit value stays)."""
        if self.use_rollout_routing_replay:
            self.use_routing_replay = True  # as Miles: the rollout's routing replaces the first pass's record
        if self.critic_lr is None:
            self.critic_lr = self.lr
