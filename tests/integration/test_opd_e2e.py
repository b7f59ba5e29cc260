"""On-policy distillation end to end on the CPU demo: a trained teacher served by the run, a student that learns.

The teacher is a tiny model fine-tuned here, in a few seconds, to answer the demo's prompts ("copy 7 :"
-> " 7"); the run serves it itself (`--opd-teacher-load`). The student is the demo's random model.
Both runs use one sample per prompt, the shape of Miles' OPD recipes: there a group's normalised
reward is always zero, so GRPO alone has no signal, and the teacher's per-token log-probs are what the
student learns from. The distilled student's reward rises toward the teacher's while GRPO alone stays
where it started, and the reverse KL to the teacher (`train/opd_reverse_kl`) falls. With 8 samples per
prompt GRPO learns this task at least as fast (docs/distillation.md has both measurements).
Deterministic sampling (`--deterministic`) makes both runs reproducible on one machine.

The checks take the best three steps, not the end of the run: how far the student moves is stable across
machines, whether it stays there is not. On an AMD EPYC, whose float sums round differently in the last
bits, the same run rose from 0.29 to 0.37 (steps 3-5) with the reverse KL from 2.26 to 1.51, then drifted
back to 0.24 and 1.76 by step 16; where the recorded run was made it kept rising (docs/distillation.md).
"""

from __future__ import annotations

import asyncio
from statistics import mean

import pytest
import torch
from e2e_helpers import run_train

from miles.engines.embedded.engine import EmbeddedEngine
from miles.models.tiny import make_tiny_model
from miles.recipes.digit_copy import first_digit_reward

STEPS = 16
COMMON = (
    f"--deterministic --num-rollout {STEPS} --n-samples-per-prompt 1 --rollout-batch-size 128 --lr 0.001 "
    "--eval-interval 0"
).split()


def fine_tune(path: str, *, seed: int, steps: int, shift: int = 0) -> str:
    """A tiny model fine-tuned on "copy D :" -> " E<|im_end|>", E = (D + shift) % 10 (NLL of the answer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = make_tiny_model(
        path + "-init", arch="qwen2", layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, seed=seed
    )
    tok = AutoTokenizer.from_pretrained(src)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(seed)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    for _ in range(steps):
        rows = []
        for d in torch.randint(0, 10, (32,), generator=gen).tolist():
            prompt = tok(f"copy {d} :", add_special_tokens=False)["input_ids"]
            rows.append((prompt, tok(f" {(d + shift) % 10}", add_special_tokens=False)["input_ids"] + [eos]))
        ids = torch.tensor([p + a for p, a in rows])  # every prompt and answer has the same length
        answer = torch.tensor([[0] * len(p) + [1] * len(a) for p, a in rows], dtype=torch.float32)[:, 1:]
        logp = torch.log_softmax(model(input_ids=ids).logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
        loss = -(logp * answer).sum() / answer.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def sampled_reward(path: str) -> float:
    """The demo reward of 200 answers sampled at temperature 1 (the rollout's) from the model at `path`."""

    async def main() -> list[dict]:
        engine = EmbeddedEngine(path, seed=1)
        await engine.start()
        try:
            return await asyncio.gather(
                *[
                    engine.generate(
                        text=f"copy {i % 10} :",
                        sampling_params={"temperature": 1.0, "max_new_tokens": 6, "sampling_seed": i},
                    )
                    for i in range(200)
                ]
            )
        finally:
            await engine.shutdown()

    outs = asyncio.run(main())
    return mean(first_digit_reward(o["text"], str(i % 10)) for i, o in enumerate(outs))


def curve(rows: list[dict], key: str) -> list[float]:
    return [r[key] for r in rows if key in r]


def window_means(values: list[float], pick, width: int = 3) -> float:
    """The highest (pick=max) or lowest (min) mean of `width` consecutive values."""
    return pick(mean(values[i : i + width]) for i in range(len(values) - width + 1))


@pytest.mark.slow
def test_distilled_student_approaches_the_teacher_where_grpo_alone_cannot(tmp_path):
    teacher = fine_tune(str(tmp_path / "teacher"), seed=7, steps=200)
    student = fine_tune(str(tmp_path / "student"), seed=1234, steps=150, shift=1)  # answers D + 1
    teacher_reward, student_reward = sampled_reward(teacher), sampled_reward(student)
    assert teacher_reward > 0.8 and student_reward < 0.35
    flags = (*COMMON, "--hf-checkpoint", student)
    opd = run_train(tmp_path / "opd", *flags, "--use-opd", "--opd-teacher-load", teacher)
    grpo = run_train(tmp_path / "grpo", *flags)
    opd_reward, grpo_reward = curve(opd, "rollout/reward_mean"), curve(grpo, "rollout/reward_mean")
    assert len(opd_reward) == len(grpo_reward) == STEPS
    # the best three steps against the first three (single steps of 128 samples are noisy): how far the
    # student gets, not whether it stays there (see the module docstring)
    start, best = mean(opd_reward[:3]), window_means(opd_reward, max)
    assert best > start + 0.04, f"the distilled student did not learn: {opd_reward}"
    assert best > window_means(grpo_reward, max) + 0.04, f"distillation {opd_reward} vs GRPO alone {grpo_reward}"
    kl = curve(opd, "train/opd_reverse_kl")
    assert window_means(kl, min) < mean(kl[:3]) - 0.3, f"the reverse KL to the teacher did not fall: {kl}"
    assert curve(opd, "rollout/opd_teacher_samples/default") == [128.0] * STEPS  # every sample scored
    assert not curve(grpo, "train/opd_reverse_kl")
    # top-K: the estimate is the sampled term's baseline. As the penalty itself it pushed every sampled
    # token down: reward 0.26 -> 0.00 and the KL 2.3 -> 6.3 on this run (docs/distillation.md)
    topk = run_train(
        tmp_path / "topk", *flags, "--use-opd", "--opd-teacher-load", teacher, "--opd-log-prob-top-k", "10"
    )
    topk_kl, topk_reward = curve(topk, "train/opd_reverse_kl"), curve(topk, "rollout/reward_mean")
    assert mean(topk_kl[STEPS // 2 :]) < mean(topk_kl[:3]) - 0.2, f"top-K: the reverse KL did not fall: {topk_kl}"
    assert mean(topk_reward[STEPS // 2 :]) > mean(topk_reward[:3]) - 0.05, f"top-K: the reward fell: {topk_reward}"
