"""Miles flags this port cannot honour, in general or in one mode: refused at start-up by name.

A launch script ported from Miles must never have a flag silently change meaning. Every flag
either works as in Miles or is refused here, before any worker starts, with the flag, the mode
and what to use instead. `NOT_IMPLEMENTED` lists the flags refused whenever they differ from
their default; `check_mode_support` refuses the ones that work in some modes only.
tests/unit/test_flags_read.py walks every config field and fails when one is read nowhere
outside the config code and is not listed here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from miles.config_fields import FIELDS
from miles.config_sections import ENGINE_DTYPES

if TYPE_CHECKING:
    from miles.config_sections import MilesConfig

# field -> (why it is refused, what to use instead); refused whenever its value is not the default.
NOT_IMPLEMENTED: dict[str, tuple[str, str]] = {}


def check_not_implemented(cfg: MilesConfig) -> list[str]:
    errors = []
    for name, (why, instead) in NOT_IMPLEMENTED.items():
        value = cfg.get(name)
        if value != FIELDS[name].default:
            errors.append(f"{FIELDS[name].flag}={value!r} is not supported: {why}; {instead}")
    return errors


def _fully_async_only(cfg: MilesConfig) -> list[str]:
    """Flags the sync loop would ignore."""
    e, ev = [], cfg.eval
    if ev.eval_mode != "shared" and not cfg.async_.fully_async:
        e.append(
            f"--eval-mode={ev.eval_mode} works only with --fully-async; the sync loop evaluates on the rollout "
            "engines between steps: drop --eval-mode, or add --fully-async"
        )
    if ev.eval_num_engines > 0 and not (cfg.async_.fully_async and ev.eval_mode == "dedicated"):
        e.append(
            f"--eval-num-engines={ev.eval_num_engines} starts engines only with --fully-async --eval-mode dedicated; "
            "drop --eval-num-engines, or add those two"
        )
    return e


def _sync_only(cfg: MilesConfig) -> list[str]:
    """Flags the fully async loop would ignore."""
    if not cfg.async_.fully_async:
        return []
    e, r = [], cfg.rollout
    if r.recompute_logprobs_via_prefill:
        e.append(
            "--recompute-logprobs-via-prefill is not supported with --fully-async (Miles refuses it too); "
            "drop it, or use --use-tis to correct the rollout log-probs"
        )
    if r.reward_phase != "inline":
        e.append(
            f"--reward-phase={r.reward_phase} does not apply to --fully-async, which scores each sample as it "
            "finishes; use --reward-phase inline, or drop --fully-async"
        )
    if r.rollout_sample_filter_path:
        e.append(
            "--rollout-sample-filter-path runs only in the sync loop; with --fully-async filter whole groups "
            "with --dynamic-sampling-filter-path, or drop --fully-async"
        )
    if cfg.weights.update_weights_interval != 1:
        e.append(
            f"--update-weights-interval={cfg.weights.update_weights_interval} is for the sync loop; "
            "--fully-async pushes after every train step: bound staleness with --max-weight-staleness"
        )
    return e


def _weights_interval(cfg: MilesConfig) -> list[str]:
    n, t = cfg.weights.update_weights_interval, cfg.train
    if n < 1:
        return [f"--update-weights-interval={n} must be at least 1 (push weights every N rollout steps)"]
    if (
        n > 1
        and cfg.engine.colocate
        and t.offload_rollout is not False
        and {"weight", "weights"} & set(t.offload_rollout_level)
    ):
        return [
            f"--update-weights-interval={n} with --colocate: the engines release their weights while the trainer "
            "trains and need a push every step; use --offload-rollout-level kv_cache, or --update-weights-interval 1"
        ]
    return []


def _parallelism(cfg: MilesConfig) -> list[str]:
    """Megatron's model-parallel flags: only under --train-backend megatron, and only what it runs."""
    t, a = cfg.train, cfg.algo
    tp, pp, cp = t.tensor_model_parallel_size, t.pipeline_model_parallel_size, t.context_parallel_size
    ep, etp = t.expert_model_parallel_size, t.expert_tensor_parallel_size
    if t.train_backend != "megatron":
        set_flags = [
            f
            for f, on in (
                ("--tensor-model-parallel-size", tp != 1),
                ("--pipeline-model-parallel-size", pp != 1),
                ("--context-parallel-size", cp != 1),
                ("--sequence-parallel", t.sequence_parallel),
                ("--expert-model-parallel-size", ep != 1),
                ("--expert-tensor-parallel-size", etp != 1),
            )
            if on
        ]
        return (
            [
                f"{', '.join(set_flags)} need --train-backend megatron (FSDP shards data-parallel only); "
                "add --train-backend megatron or drop them"
            ]
            if set_flags
            else []
        )
    e = []
    if min(tp, pp, cp) < 1 or cfg.trainer_world_size % (tp * pp * cp):
        e.append(
            f"--tensor-model-parallel-size={tp} x --pipeline-model-parallel-size={pp} x --context-parallel-size={cp} "
            f"must divide the {cfg.trainer_world_size} trainer GPUs (--actor-num-nodes x --actor-num-gpus-per-node); "
            "change one of them"
        )
    e += _expert_parallelism(cfg.trainer_world_size, pp, ep, etp)
    if cp != 1:
        e.append(
            f"--context-parallel-size={cp}: context parallelism needs Transformer Engine's attention, which the "
            "megatron backend does not use; set it to 1"
        )
    if t.sequence_parallel and tp == 1:
        e.append(
            "--sequence-parallel shards activations over tensor-parallel ranks and needs "
            "--tensor-model-parallel-size > 1; drop it or raise the TP size"
        )
    if a.advantage_estimator == "ppo":
        e.append(
            "--advantage-estimator ppo needs a critic, which the megatron backend does not train; "
            "use --train-backend fsdp for PPO"
        )
    if cfg.model.dtype == "float16" or cfg.model.dtype == "fp16":
        e.append("--dtype float16 needs a loss scaler, which the megatron backend does not run; use bfloat16")
    if t.compile:
        e.append("--compile compiles the HF model's blocks, which the megatron backend does not train; drop it")
    return e


def _expert_parallelism(world: int, pp: int, ep: int, etp: int) -> list[str]:
    """Megatron's MoE layout: expert ranks (EP x expert-TP) tile each pipeline stage's ranks; the expert count and
    width are checked against the model once its config is read (moe_layout.check_megatron_model)."""
    if min(ep, etp) < 1 or world % pp or (world // pp) % (ep * etp):
        return [
            f"--expert-model-parallel-size={ep} x --expert-tensor-parallel-size={etp} must divide the "
            f"{world // max(pp, 1)} trainer GPUs of each pipeline stage; change one of them"
        ]
    return []


# Built-in rollout features a --rollout-function-path replaces: given with one, they would do nothing.
_BUILT_IN_ROLLOUT_ONLY = (
    "dynamic_sampling_filter_path",
    "rollout_sample_filter_path",
    "partial_rollout",
    "recompute_logprobs_via_prefill",
    "reward_phase",
)


def _agentic(cfg: MilesConfig) -> list[str]:
    """The three plug-in layers and the session server: combinations where a flag would do nothing."""
    e, r = [], cfg.rollout
    if r.custom_agent_function_path and not r.use_session_server:
        e.append(
            "--custom-agent-function-path needs --use-session-server: the session server records the agent's "
            "tokens; add --use-session-server (v1 linear, v2 branching)"
        )
    if r.custom_agent_function_path and cfg.data.apply_chat_template:
        e.append(
            "--apply-chat-template with --custom-agent-function-path: the agent gets the prompt's messages and "
            "the session server applies the chat template; drop --apply-chat-template"
        )
    if not r.use_session_server:
        for name in ("session_message_matcher", "tito_model"):
            if cfg.get(name) != FIELDS[name].default:
                e.append(
                    f"{FIELDS[name].flag}={cfg.get(name)!r} applies to the session server only; add "
                    f"--use-session-server or drop {FIELDS[name].flag}"
                )
    plugins = r.rollout_function_path or r.custom_generate_function_path or r.custom_agent_function_path
    if r.session_server_port and not (r.use_session_server or plugins):
        e.append(
            f"--session-server-port={r.session_server_port}: no session server or plug-in gateway starts "
            "without --use-session-server or a custom rollout/generate/agent function; drop it"
        )
    if r.partial_rollout and (r.custom_generate_function_path or r.custom_agent_function_path):
        e.append(
            "--partial-rollout resumes samples in the built-in generate only; a custom generate or agent "
            "function would get half-finished samples: drop --partial-rollout"
        )
    if r.rollout_function_path:
        if cfg.async_.fully_async:
            e.append(
                "--rollout-function-path replaces the sync rollout; --fully-async runs its own producer (Miles "
                "refuses the pair too): drop one, or plug in at --custom-generate-function-path"
            )
        for name in _BUILT_IN_ROLLOUT_ONLY:
            if cfg.get(name) != FIELDS[name].default:
                e.append(
                    f"{FIELDS[name].flag} belongs to the built-in rollout, which --rollout-function-path "
                    "replaces; drop it, or do the same inside the rollout function"
                )
    if r.generate_max_turns < 1:
        e.append(f"--generate-max-turns={r.generate_max_turns} must be at least 1")
    return e


def _true_on_policy(cfg: MilesConfig) -> list[str]:
    """What --true-on-policy-mode cannot make bit-exact (the model itself is checked once its config is read)."""
    if not cfg.train.true_on_policy_mode:
        return []
    e, why = [], "--true-on-policy-mode"
    if cfg.engine.engine != "embedded" or cfg.engine.rollout_external_engine_addrs:
        e.append(
            f"{why} needs the embedded engine, whose re-scoring runs the trainer's reference forward; the "
            "kernels of an SGLang or external engine are not under this run's control: drop --engine sglang / "
            "--rollout-external-engine-addrs, or drop the mode"
        )
    if cfg.rollout.rollout_function_path:
        e.append(
            f"{why} re-scores every sample in the built-in rollout, which --rollout-function-path replaces; "
            "plug in at --custom-generate-function-path instead, or drop the mode"
        )
    if cfg.async_.fully_async:
        e.append(f"{why} re-scores each sample by prefill, which the sync loop does (as Miles); drop --fully-async")
    if cfg.algo.loss_type == "sft_loss":
        e.append(f"{why} aligns the rollout's log-probs with the trainer's; SFT has no rollout: drop the mode")
    if cfg.train.train_backend != "fsdp":
        e.append(f"{why} is implemented by the FSDP backend's trainer; use --train-backend fsdp")
    given = cfg.engine.sglang_args.get("dtype")
    if given is not None and ENGINE_DTYPES.get(str(given)) != cfg.model.dtype:
        e.append(
            f"{why} runs the engine in the trainer's --dtype={cfg.model.dtype}; drop --sglang-dtype={given} "
            "(or give --dtype the same value)"
        )
    if cfg.train.lora_rank:
        e.append(
            f"{why} with --lora-rank: the engine merges the adapter into its weights while the trainer adds it "
            "as a separate low-rank path, which round differently; drop one"
        )
    if cfg.train.compile:
        e.append(f"{why} runs the engine's eager reference forward on the trainer too; drop --compile")
    if cfg.train.use_dynamic_batch_size and cfg.dp_size > 1:
        e.append(
            f"{why} forwards one sequence at a time and every rank must run as many forwards: with "
            f"{cfg.dp_size} trainer ranks use fixed --micro-batch-size instead of --use-dynamic-batch-size"
        )
    return e


def _routing_replay(cfg: MilesConfig) -> list[str]:
    """Where --use-(rollout-)routing-replay cannot act (a dense model is refused once its config is read)."""
    t = cfg.train
    if not t.use_routing_replay:
        return []
    why = "--use-rollout-routing-replay" if t.use_rollout_routing_replay else "--use-routing-replay"
    e = []
    if t.train_backend == "megatron":
        e += [
            f"{why} with {flag}: {reason}; drop one"
            for flag, on, reason in (
                ("--pipeline-model-parallel-size > 1", t.pipeline_model_parallel_size > 1, "replay needs every layer"),
                ("--tensor-model-parallel-size > 1", t.tensor_model_parallel_size > 1, "routers see a sequence shard"),
                ("--gradient-checkpointing", t.gradient_checkpointing, "a recomputed router would not replay"),
            )
            if on
        ]
    if t.true_on_policy_mode:
        e.append(f"{why} with --true-on-policy-mode: the reference forward routes by itself; drop one")
    if not t.use_rollout_routing_replay and cfg.algo.use_rollout_logprobs:
        e.append(
            "--use-routing-replay records routing in the old log-prob forward, which --use-rollout-logprobs skips; "
            "drop --use-rollout-logprobs, or use --use-rollout-routing-replay"
        )
    if cfg.algo.loss_type == "sft_loss":
        e.append(f"{why} replays a rollout's routing; SFT has no rollout: drop it")
    return e


# Miles flags a launched SGLang server reads under its own name (`placement.sglang_launch_args`).
SGLANG_NAMES = {"max_running_requests": "--max-running-requests", "max_total_tokens": "--max-total-tokens"}


def _sglang_engine(cfg: MilesConfig) -> list[str]:
    """What a launched (vanilla) SGLang server cannot do, refused before any worker starts; engines given by
    --rollout-external-engine-addrs are probed for the endpoints when the weight path connects."""
    eng = cfg.engine
    if eng.engine != "sglang" or eng.rollout_num_engines == 0:
        return []
    e = [
        f"{flag} and --sglang-{key.replace('_', '-')} both set SGLang's --{key.replace('_', '-')}; give it once"
        for key, flag in SGLANG_NAMES.items()
        if getattr(eng, key) is not None and key in eng.sglang_args
    ]
    default_body_mb = FIELDS["http_max_body_mb"].default
    if eng.http_max_body_mb != default_body_mb:
        e.append(
            f"--http-max-body-mb={eng.http_max_body_mb} limits the embedded engine's request bodies; SGLang has no "
            "such limit: drop it with --engine sglang"
        )
    if cfg.weights.update_weight_transfer_mode == "disk-delta":
        e.append(
            "--update-weight-transfer-mode=disk-delta patches each engine host's copy through /pull_weights, which "
            "vanilla SGLang does not serve (the embedded engine and Miles' SGLang fork do); with --engine sglang "
            "use broadcast or p2p"
        )
    if cfg.weights.check_weight_update_equal:
        e.append(
            "--check-weight-update-equal needs the digest weight checker (/weights_checker with fill_noise), "
            "which the embedded engine serves and SGLang does not; drop it with --engine sglang, or use "
            "--engine embedded"
        )
    return e


def check_mode_support(cfg: MilesConfig) -> list[str]:
    """Flags that work in some modes only, refused in the others."""
    e = _fully_async_only(cfg) + _sync_only(cfg) + _weights_interval(cfg) + _agentic(cfg) + _true_on_policy(cfg)
    e += _routing_replay(cfg) + _sglang_engine(cfg)
    eng = cfg.engine
    if eng.engine == "embedded" and eng.rollout_num_gpus_per_engine > 1:
        e.append(
            f"--rollout-num-gpus-per-engine={eng.rollout_num_gpus_per_engine} with --engine embedded: the embedded "
            f"engine runs on one device and would reserve {eng.rollout_num_gpus_per_engine - 1} GPU(s) it never "
            "uses; use --engine sglang for tensor-parallel engines, or set it to 1"
        )
    e += _parallelism(cfg)
    log = cfg.logging
    if log.use_wandb and not log.wandb_project:
        e.append("--use-wandb needs --wandb-project NAME (the W&B project the run logs to)")
    unused = [
        f
        for f, v in (
            ("--wandb-project", log.wandb_project),
            ("--wandb-group", log.wandb_group),
            ("--wandb-mode", log.wandb_mode),
        )
        if v is not None
    ]
    if unused and not log.use_wandb:
        e.append(f"{', '.join(unused)} without --use-wandb logs nothing to W&B; add --use-wandb or drop them")
    return e
