"""The `algo` section: the objective: advantages, clipping, KL, corrections, on-policy distillation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from miles.config.option import option


@dataclass
class AlgoConfig:
    """The objective: advantages, clipping, KL, corrections, on-policy distillation."""

    advantage_estimator: Literal["grpo", "gspo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo"] = (
        option("grpo", "{choices}")
    )
    loss_type: Literal["policy_loss", "sft_loss", "custom_loss"] = option("policy_loss", "{choices}")
    custom_loss_function_path: str | None = option(None, "import path of a custom loss")
    eps_clip: float = option(0.2, "PPO clip epsilon (low)", range="[0, inf)", unit="the PPO clip range")
    eps_clip_high: float | None = option(
        None, "PPO clip epsilon (high; default eps_clip)", range="[0, inf)", unit="the PPO clip range"
    )
    eps_clip_c: float | None = option(
        None, "dual-clip constant c > 1", range="(1, inf)", unit="the dual-clip constant"
    )
    use_kl_loss: bool = option(False, "add a KL(actor || ref) loss term")
    kl_loss_coef: float = option(0.0, "coefficient of the KL loss", range="[0, inf)", unit="a coefficient")
    kl_loss_type: Literal["k1", "k2", "k3", "low_var_kl"] = option("k1", "{choices}")
    kl_coef: float = option(0.0, "KL-in-reward coefficient (reward shaping)", range="[0, inf)", unit="a coefficient")
    entropy_coef: float = option(
        0.0, "entropy bonus coefficient", range="(-inf, inf)", unit="a coefficient (negative penalises entropy)"
    )
    gamma: float = option(1.0, "discount", range="[0, 1]", unit="a discount")
    lambd: float = option(1.0, "GAE lambda", range="[0, 1]", unit="the GAE lambda")
    normalize_advantages: bool = option(False, "masked whitening of advantages across data-parallel ranks")
    disable_grpo_std_normalization: bool = option(False, "Dr.GRPO: center rewards without dividing by the group std")
    disable_rewards_normalization: bool = option(False, "skip group reward normalization")
    value_clip: float = option(0.2, "PPO value clip", range="[0, inf)", unit="the value clip range")
    use_rollout_logprobs: bool = option(False, "use rollout log-probs as the old policy (skip actor forward)")
    use_tis: bool = option(False, "truncated importance sampling on train/rollout ratio")
    tis_mode: Literal["clamp", "clip_or_pop"] = option(
        "clamp", "{choices}", notes={"clamp": "TIS", "clip_or_pop": "zero weight outside [lo, hi]"}
    )
    tis_clip: float = option(2.0, "TIS upper bound", range="(0, inf)", unit="the TIS upper bound")
    tis_clip_low: float = option(0.0, "TIS lower bound", range="[0, inf)", unit="the TIS lower bound")
    custom_tis_function_path: str | None = option(None, "import path of a custom correction")
    calculate_per_token_loss: bool = option(False, "aggregate as a global token mean")
    loss_aggregation: Literal["sample_mean", "token_mean", "seq_mean_token_sum"] | None = option(
        None, "{choices}", notes={"sample_mean": "default"}
    )
    use_opd: bool = option(
        False,
        "on-policy distillation: a teacher scores every sampled token; the reverse-KL estimate, times --opd-kl-coef, is subtracted from the advantage",
    )
    opd_type: Literal["sglang", "megatron"] | None = option(
        None,
        "where the teacher runs: {choices}; default: from the flags given",
        notes={
            "sglang": "served: --opd-teacher-urls",
            "megatron": "a checkpoint: --opd-teacher-load, served by this run on an engine of its own",
        },
    )
    opd_kl_coef: float = option(1.0, "OPD coefficient", range="[0, inf)", unit="a coefficient")
    opd_log_prob_top_k: int = option(
        0,
        "top-K OPD: estimate each position's reverse KL over K candidate tokens, the sampled token's baseline (0: none)",
        range="[0, 1024]",
        unit="candidate tokens per position (the engines return at most 1024)",
    )
    opd_top_k_strategy: Literal["only-student", "only-teacher", "intersection", "union", "xor"] = option(
        "only-student", "top-K candidate set: {choices}"
    )
    opd_reward_weight_mode: Literal["student_p", "teacher_p", "none"] = option(
        "student_p", "top-K weights of the candidates: {choices}", notes={"none": "uniform"}
    )
    opd_teacher_urls: list[str] = option(
        [],
        "served teachers as NAME=URL (SGLang protocol: an SGLang server or `miles engine serve`); each prompt goes to the teacher named by its metadata[--opd-teacher-key], else to 'default'",
        nargs="*",
    )
    opd_teacher_key: str = option(
        "opd_teacher", "prompt metadata key naming the teacher that scores the prompt's samples"
    )
    opd_teacher_load: str | None = option(
        None,
        "HF directory of a teacher this run serves itself, on one engine of its own (teacher name 'default'); same tokenizer as the student",
    )

    def derive(self) -> None:
        """The values this section derives from its own flags (an explicit value stays)."""
        if self.eps_clip_high is None:
            self.eps_clip_high = self.eps_clip
        if self.loss_aggregation is None:
            self.loss_aggregation = "token_mean" if self.calculate_per_token_loss else "sample_mean"
