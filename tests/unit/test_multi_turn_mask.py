"""Multi-turn samples: tokens the model did not generate carry no weight anywhere in the objective.

A two-turn trajectory (model, tool output, model, user turn, model) goes through the train-data
conversion, the advantages (GRPO with the OPD penalty) and the policy loss with TIS. The reference
is the same computation on the compacted sequences, the model's tokens only: the loss and its
gradient must agree, the gradient at masked positions must be zero, and any value at masked
positions (log-probs of every kind) must change nothing.
"""

from __future__ import annotations

import pytest
import torch

from miles.agent.trajectory import Trajectory
from miles.algo.advantages import compute_advantages_and_returns
from miles.algo.aggregation import StepDenominators
from miles.algo.losses import LossInputs, policy_loss
from miles.config import AlgoConfig
from miles.rollout.sample import Sample
from miles.rollout.train_data import samples_to_train_batch

torch.set_num_threads(1)
CFG = AlgoConfig(use_tis=True, tis_clip=1.5, tis_clip_low=0.5, use_opd=True, opd_kl_coef=0.5)


def _trajectory_sample(index: int, turns: list[tuple[str, int]], reward: float, seed: int) -> Sample:
    g = torch.Generator().manual_seed(seed)
    traj = Trajectory(prompt_ids=[1, 2, 3])
    for kind, n in turns:
        ids = torch.randint(4, 50, (n,), generator=g).tolist()
        if kind == "model":
            lps = (-torch.rand(n, generator=g)).tolist()
            traj.add_model_turn(ids, lps, [index] * n, "stop")
        else:
            traj.add_env_tokens(ids)
    sample = traj.fill(Sample(group_index=0, index=index), _Decoder())
    sample.reward = reward
    return sample


class _Decoder:
    @staticmethod
    def decode(ids, skip_special_tokens=False):
        return " ".join(map(str, ids))


def _objective(mask, lengths, rewards, new, old, rollout, teacher):
    den = StepDenominators(num_samples=len(lengths), num_tokens=int(mask.sum()))
    adv, _ = compute_advantages_and_returns(
        CFG, rewards=rewards, response_lengths=lengths, loss_mask=mask, log_probs=old, teacher_log_probs=teacher
    )
    loss, _ = policy_loss(
        CFG, LossInputs(new, mask, lengths, den, old_log_probs=old, advantages=adv, rollout_log_probs=rollout)
    )
    return loss


def _batch():
    samples = [
        _trajectory_sample(0, [("model", 4), ("env", 3), ("model", 2), ("env", 5), ("model", 3)], 1.0, seed=1),
        _trajectory_sample(1, [("model", 5)], 0.0, seed=2),
    ]
    batch = samples_to_train_batch(
        samples, reward_key=None, estimator="grpo", std_normalization=True, disable_rewards_normalization=False
    )
    return samples, batch


def test_conversion_keeps_the_turn_structure_of_the_mask():
    samples, batch = _batch()
    assert batch.response_lengths.tolist() == [17, 5]
    assert batch.loss_masks.tolist() == [1] * 4 + [0] * 3 + [1] * 2 + [0] * 5 + [1] * 3 + [1] * 5
    assert batch.rollout_log_probs[4:7].tolist() == [0.0] * 3
    assert samples[0].weight_versions == [0] * 17  # env tokens take the version of the turn before them


def test_masked_positions_carry_no_weight_in_advantages_opd_tis_and_loss():
    _, batch = _batch()
    g = torch.Generator().manual_seed(0)
    total = int(batch.response_lengths.sum())
    mask = torch.as_tensor(batch.loss_masks)
    rewards = torch.as_tensor(batch.rewards)
    lengths = batch.response_lengths.tolist()
    rollout = torch.as_tensor(batch.rollout_log_probs)
    old = rollout + 0.05 * torch.randn(total, generator=g)
    teacher = rollout - 0.3 * torch.rand(total, generator=g)
    new_values = old + 0.2 * torch.randn(total, generator=g)

    new = new_values.clone().requires_grad_(True)
    loss = _objective(mask, lengths, rewards, new, old, rollout, teacher)
    loss.backward()

    keep = mask.bool()
    compact_lengths = [int(m.sum()) for m in torch.split(mask, lengths)]
    compact_new = new_values[keep].clone().requires_grad_(True)
    reference = _objective(
        torch.ones(int(keep.sum())), compact_lengths, rewards, compact_new, old[keep], rollout[keep], teacher[keep]
    )
    reference.backward()
    assert loss.item() == pytest.approx(reference.item(), rel=1e-6, abs=1e-7)
    assert torch.allclose(new.grad[keep], compact_new.grad, atol=1e-7)
    assert torch.count_nonzero(new.grad[~keep]) == 0

    garbage = torch.where(keep, torch.zeros(total), torch.full((total,), 40.0))  # far outside every clip range
    again = (new_values + garbage).requires_grad_(True)
    same = _objective(mask, lengths, rewards, again, old - garbage, rollout - 2 * garbage, teacher + garbage)
    assert same.item() == pytest.approx(loss.item(), rel=1e-6, abs=1e-7)
