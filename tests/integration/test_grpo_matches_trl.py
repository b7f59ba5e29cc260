"""One GRPO update, miles against TRL's GRPOTrainer, on the same model, prompts, responses and rewards.

What `bench/e2e_vs_trl.py` runs on both sides: group-normalised advantages (std-scaled), the loss averaged
over the batch's tokens (TRL's `loss_type="dapo"`, miles' `--loss-aggregation token_mean`), log-probs at
the sampling temperature, old log-probs equal to the current ones (one optimizer step a rollout), no KL.
fp32 on CPU: the two gradients are the same function of the batch, so they agree to rounding; any
algorithmic difference (a normaliser, the temperature, which tokens count, the advantage's scale) would
move them by far more. Responses end in the end-of-turn token or run to the length limit, as in a rollout.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from _trainer_harness import capture_grads_at_step, configs, run_ranks  # isort: skip

pytest.importorskip("trl")

GROUPS, GROUP_SIZE, MAX_NEW, TEMPERATURE = 4, 4, 6, 0.8


def _batch(tokenizer, seed: int = 0) -> dict:
    """Prompts (chat template), responses (some closed by the end-of-turn token), 0/1 rewards."""
    rng = np.random.default_rng(seed)
    questions = ["What is 2 + 2?", "What is 13 * 7?", "Name a colour.", "What is 100 - 1? Answer briefly."]
    prompts, responses, rewards, groups = [], [], [], []
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for g, q in enumerate(questions[:GROUPS]):
        prompt = list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], tokenize=True, add_generation_prompt=True, return_dict=False
            )
        )
        for i in range(GROUP_SIZE):
            n = int(rng.integers(2, MAX_NEW + 1))
            body = rng.integers(10, tokenizer.vocab_size - 10, size=n).tolist()
            closed = i % 2 == 0 and n < MAX_NEW
            prompts.append(prompt)
            responses.append(body + [eos] if closed else body)
            rewards.append(float(rng.random() < 0.5) if i else float(g % 2))  # no group all-equal by chance
            groups.append(g)
    for g in range(GROUPS):  # a group whose rewards are all equal trains on nothing: keep every group mixed
        idx = [k for k in range(len(groups)) if groups[k] == g]
        if len({rewards[k] for k in idx}) == 1:
            rewards[idx[0]] = 1.0 - rewards[idx[0]]
    return {"prompts": prompts, "responses": responses, "rewards": rewards, "groups": groups}


def _miles_grads(model_dir: str, batch: dict) -> tuple[dict, np.ndarray]:
    from miles.algo.reward_norm import normalize_group_rewards
    from miles.rollout.train_data import TrainBatch
    from miles.trainer.backend import create_backend

    n = len(batch["prompts"])
    advantages = normalize_group_rewards(
        np.array(batch["rewards"], np.float32), np.array(batch["groups"]), estimator="grpo", std_normalization=True
    )
    seqs = [p + r for p, r in zip(batch["prompts"], batch["responses"], strict=True)]
    resp = np.array([len(r) for r in batch["responses"]], np.int64)
    train_batch = TrainBatch(
        tokens=np.concatenate(seqs).astype(np.int64),
        seq_lens=np.array([len(s) for s in seqs], np.int64),
        response_lengths=resp,
        loss_masks=np.ones(int(resp.sum()), np.float32),
        rewards=advantages,
        raw_rewards=np.array(batch["rewards"], np.float32),
        group_index=np.array(batch["groups"], np.int64),
        sample_index=np.arange(n),
        truncated=np.array([r[-1] != batch["eos"] for r in batch["responses"]], np.int8),
    )
    be = create_backend(
        "fsdp",
        **configs(
            model_dir,
            algo={"advantage_estimator": "grpo", "loss_aggregation": "token_mean"},
            train={"micro_batch_size": 3},  # several micro-batches: the token mean must span all of them
            rollout={"global_batch_size": n, "rollout_temperature": TEMPERATURE},
        ),
    )
    be.setup()
    captured = capture_grads_at_step(be)
    be.train(train_batch, rollout_id=0)
    return captured, advantages


def _trl_grads(model_dir: str, batch: dict, advantages_in: np.ndarray) -> tuple[dict, np.ndarray]:
    """TRL's gradient for `advantages_in`, and the advantages TRL's own formula gives for the rewards."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    n = len(batch["prompts"])
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=lambda completions, **_: [0.0] * len(completions),
        args=GRPOConfig(
            output_dir=os.path.join(model_dir, "trl-out"),
            per_device_train_batch_size=n,
            num_generations=GROUP_SIZE,
            max_completion_length=MAX_NEW,
            temperature=TEMPERATURE,
            beta=0.0,
            bf16=False,  # TRL's default is bf16 autocast, on CPU too; fp32 here so that rounding cannot hide a gap
            use_cpu=True,
            report_to=[],
        ),
        train_dataset=Dataset.from_list([{"prompt": "x"}] * n),
        processing_class=tokenizer,
    )
    assert trainer.loss_type == "dapo" and trainer.scale_rewards == "group"  # the defaults the bench runs
    assert trainer.accelerator.mixed_precision == "no"
    rewards = torch.tensor(batch["rewards"])
    grouped = rewards.view(-1, GROUP_SIZE)  # TRL's group normalisation, as in _generate_and_score_completions
    advantages = (rewards - grouped.mean(1).repeat_interleave(GROUP_SIZE)) / (
        grouped.std(1).repeat_interleave(GROUP_SIZE) + 1e-4
    )
    pad = tokenizer.pad_token_id
    width_p = max(len(p) for p in batch["prompts"])
    width_c = max(len(r) for r in batch["responses"])
    prompt_ids = torch.tensor([[pad] * (width_p - len(p)) + p for p in batch["prompts"]])  # left padding
    prompt_mask = torch.tensor([[0] * (width_p - len(p)) + [1] * len(p) for p in batch["prompts"]])
    completion_ids = torch.tensor([r + [pad] * (width_c - len(r)) for r in batch["responses"]])  # right padding
    completion_mask = torch.tensor([[1] * len(r) + [0] * (width_c - len(r)) for r in batch["responses"]])
    inputs = {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.from_numpy(advantages_in),
        "old_per_token_logps": None,
        "num_items_in_batch": completion_mask.sum(),
    }
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    trainer._compute_loss(trainer.model, inputs).backward()
    grads = {name: p.grad.detach().clone() for name, p in trainer.model.named_parameters()}
    return grads, advantages.numpy()


def _rank_fn(rank: int, world: int, model_dir: str, out_dir: str, batch: dict) -> None:
    grads, advantages = _miles_grads(model_dir, batch)
    torch.save({"grads": grads, "advantages": advantages}, os.path.join(out_dir, "miles.pt"))


def test_one_grpo_update_has_trls_gradient(tmp_path):
    from transformers import AutoTokenizer

    from miles.models.resolve import resolve_spec

    model_dir = resolve_spec("tiny:qwen2")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    batch = _batch(tokenizer)
    batch["eos"] = tokenizer.convert_tokens_to_ids("<|im_end|>")
    run_ranks(_rank_fn, 1, model_dir, str(tmp_path), batch)
    ours = torch.load(tmp_path / "miles.pt", weights_only=False)
    theirs, trl_advantages = _trl_grads(model_dir, batch, ours["advantages"])

    # the same advantages, up to the std's epsilon (miles 1e-6, TRL 1e-4: a 2e-4 relative difference here);
    # the gradients are then compared for the same advantages
    np.testing.assert_allclose(ours["advantages"], trl_advantages, rtol=1e-3, atol=1e-6)
    assert set(ours["grads"]) == set(theirs), set(ours["grads"]) ^ set(theirs)
    flat_ours = torch.cat([ours["grads"][k].flatten() for k in sorted(theirs)])
    flat_theirs = torch.cat([theirs[k].flatten() for k in sorted(theirs)])
    assert flat_theirs.norm() > 1e-3  # a real gradient, not two zeros
    torch.testing.assert_close(flat_ours, flat_theirs, rtol=1e-4, atol=1e-8)
