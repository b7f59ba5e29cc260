"""The batch knobs: rollout_batch_size × n_samples_per_prompt = global_batch_size × num_steps_per_rollout, the
fourth derived from three; --num-rollout from --num-epoch; the batch shapes the trainer can split."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from miles.config.fields import ConfigError, flag

if TYPE_CHECKING:
    from miles.config.sections import MilesConfig

logger = logging.getLogger(__name__)

KNOBS = ("rollout_batch_size", "n_samples_per_prompt", "global_batch_size", "num_steps_per_rollout")


EQUATION = "rollout_batch_size × n_samples_per_prompt = global_batch_size × num_steps_per_rollout"


def resolve_batch_knobs(cfg: MilesConfig, explicit: set[str]) -> list[str]:
    """Fill the missing knob of rbs × n = gbs × steps, or report why it cannot hold."""
    r = cfg.rollout
    known = {
        k: getattr(r, k) for k in KNOBS if getattr(r, k) is not None and (k in explicit or k != "n_samples_per_prompt")
    }
    bad = [f"{flag(k)}={v} must be a positive integer" for k, v in known.items() if v <= 0]
    if bad:
        return bad
    # Too few to derive anything: take the group size's default (1), then one optimizer step per rollout.
    for knob, default in (("n_samples_per_prompt", 1), ("num_steps_per_rollout", 1)):
        if len(known) < 3 and knob not in known:
            known[knob] = default
    for knob in ("n_samples_per_prompt", "num_steps_per_rollout"):
        if knob in known:
            setattr(r, knob, known[knob])
    if len(known) < 3:
        return []  # neither rollout_batch_size nor global_batch_size: reported by the train checks
    if len(known) == 4:
        return _check_four(known)
    missing = next(k for k in KNOBS if k not in known)
    value, error = _derive_knob(missing, known)
    if error:
        return [error]
    setattr(r, missing, value)
    logger.info("derived %s=%d from %s", missing, value, EQUATION)
    return []


def _check_four(k: dict[str, int]) -> list[str]:
    rbs, n, gbs, steps = (k[name] for name in KNOBS)
    if rbs * n == gbs * steps:
        return []
    return [
        f"the batch knobs are inconsistent: rollout_batch_size={rbs} × n_samples_per_prompt={n} = {rbs * n}, but "
        f"global_batch_size={gbs} × num_steps_per_rollout={steps} = {gbs * steps}; {EQUATION} must hold. "
        "Give only three of --rollout-batch-size, --n-samples-per-prompt, --global-batch-size, "
        "--num-steps-per-rollout and the fourth is derived"
    ]


# missing knob -> (the two knobs of the other side of the equation, the knob sharing its side)
_DERIVE = {
    "global_batch_size": (("rollout_batch_size", "n_samples_per_prompt"), "num_steps_per_rollout"),
    "num_steps_per_rollout": (("rollout_batch_size", "n_samples_per_prompt"), "global_batch_size"),
    "rollout_batch_size": (("global_batch_size", "num_steps_per_rollout"), "n_samples_per_prompt"),
    "n_samples_per_prompt": (("global_batch_size", "num_steps_per_rollout"), "rollout_batch_size"),
}


def _derive_knob(missing: str, k: dict[str, int]) -> tuple[int, str | None]:
    (a, b), divisor_name = _DERIVE[missing]
    total, divisor = k[a] * k[b], k[divisor_name]
    if total % divisor:
        return 0, (
            f"cannot derive {missing} from {EQUATION}: {a} × {b} = {k[a]} × {k[b]} = {total} is not divisible by "
            f"{divisor_name}={divisor}; set {flag(divisor_name)} to a divisor of {total}, or give {flag(missing)}"
        )
    return total // divisor, None


def derive_num_rollout(cfg: MilesConfig, dataset_len: int) -> int:
    """num_rollout = num_epoch × dataset_len // rollout_batch_size, once the dataset length is known."""
    if cfg.rollout.num_rollout is not None:
        return cfg.rollout.num_rollout
    epochs, rbs = cfg.data.num_epoch, cfg.rollout.rollout_batch_size
    if epochs is None or rbs is None:
        raise ConfigError("cannot derive --num-rollout: give --num-rollout, or --num-epoch with --rollout-batch-size")
    steps = epochs * dataset_len // rbs
    if steps < 1:
        raise ConfigError(
            f"--num-epoch={epochs} over {dataset_len} prompts with --rollout-batch-size={rbs} gives 0 rollout steps; "
            f"lower --rollout-batch-size to at most {epochs * dataset_len} or raise --num-epoch"
        )
    cfg.rollout.num_rollout = steps
    return steps


def check_batching(cfg: MilesConfig) -> list[str]:
    e: list[str] = []
    r, t = cfg.rollout, cfg.train
    dp, gbs = cfg.dp_size, r.global_batch_size
    dp_text = f"data-parallel size {dp} (--actor-num-nodes={t.actor_num_nodes} × --actor-num-gpus-per-node={t.actor_num_gpus_per_node}"
    dp_text += f" / {cfg.model_parallel_size} model-parallel ranks)" if cfg.model_parallel_size > 1 else ")"
    if gbs is not None and gbs < dp:
        e.append(f"--global-batch-size={gbs} is smaller than the {dp_text}; raise it to at least {dp}")
    elif gbs is not None and gbs % dp:
        e.append(f"--global-batch-size={gbs} is not divisible by the {dp_text}; pick a multiple of {dp}")
    if t.use_dynamic_batch_size and t.max_tokens_per_gpu is None:
        e.append("--use-dynamic-batch-size needs --max-tokens-per-gpu (the token budget of one packed micro-batch)")
    osb, rbs = r.over_sampling_batch_size, r.rollout_batch_size
    if osb is not None and rbs is not None and osb < rbs:
        e.append(
            f"--over-sampling-batch-size={osb} is smaller than --rollout-batch-size={rbs}; raise it to at least {rbs}"
        )
    prompt_len, ctx = cfg.data.rollout_max_prompt_len, r.rollout_max_context_len
    if prompt_len is not None and ctx is not None and prompt_len > ctx - 1:
        e.append(
            f"--rollout-max-prompt-len={prompt_len} leaves no room to generate within --rollout-max-context-len={ctx}; "
            f"set it to at most {ctx - 1}"
        )
    if len(cfg.eval.eval_prompt_data) % 2:
        e.append(f"--eval-prompt-data takes name/path pairs, got {len(cfg.eval.eval_prompt_data)} values")
    return e
