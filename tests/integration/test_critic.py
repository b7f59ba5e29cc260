"""PPO critic of the FSDP backend on 2 gloo ranks against an independent single-process reference.

One `train()` call with `--advantage-estimator ppo` runs two optimizer steps (global batch = half
the samples). The reference, written here from the formulas: a plain HF critic (same initial
weights, no dropout), values at the positions that predict each response token, returns equal to
the sample's reward (GAE with gamma = lambda = 1), the clipped value loss
max((V_old + clamp(V - V_old, +-clip) - R)^2, (V - R)^2) as the mean over samples of each sample's
masked token mean, and torch.optim.AdamW between the steps. In step 1 V == V_old; in step 2 the
critic has moved and a small clip is active on part of the tokens, so both branches are checked.
Tolerance: fp32 on CPU, only summation order differs, so |dx| <= 1e-5 absolute (+1e-4 relative)
for losses and every gradient element.
"""

from __future__ import annotations

import os

import pytest
import torch

from _trainer_harness import configs, full_grads, make_batch, make_tiny_model, run_ranks, shard  # isort: skip

NUM_SAMPLES = 8
STEP_SAMPLES = 4  # global batch: two optimizer steps per train() call
VALUE_CLIP = 0.02
LR = 1e-2
TRAIN_CALLS = 5


def _rank_fn(rank: int, world: int, model_dir: str, out_dir: str) -> None:
    from miles.trainer.backend import create_backend

    local = shard(make_batch(NUM_SAMPLES, seed=3), rank, world, per_step=STEP_SAMPLES)
    be = create_backend(
        "fsdp",
        **configs(
            model_dir,
            algo={"advantage_estimator": "ppo", "value_clip": VALUE_CLIP},
            train={"lr": LR},
            rollout={"global_batch_size": STEP_SAMPLES},
        ),
    )
    be.setup()
    initial = {n: t.clone() for n, t in full_params(be.critic).items()}
    step_grads: list[dict[str, torch.Tensor]] = []
    step = be.critic_optimizer.step

    def capture_then_step(*a, **kw):
        if len(step_grads) < 2:
            step_grads.append(full_grads(be.critic))
        return step(*a, **kw)

    be.critic_optimizer.step = capture_then_step
    metrics = [be.train(local, rollout_id=i) for i in range(TRAIN_CALLS)]
    if rank == 0:
        torch.save({"initial": initial, "grads": step_grads, "metrics": metrics}, os.path.join(out_dir, "critic.pt"))


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded parameters by HF name (collective)."""
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for n, p in model.named_parameters()}


def _values(critic, batch, sample_ids: list[int]) -> list[torch.Tensor]:
    """Per sample, V at the positions that predict its response tokens (one forward per sequence)."""
    seqs = batch.sequences()
    out = []
    for i in sample_ids:
        r = int(batch.response_lengths[i])
        scores = critic(input_ids=torch.from_numpy(seqs[i]).unsqueeze(0)).logits[0, :, 0]
        out.append(scores[-r - 1 : -1])
    return out


def _reference(model_dir: str, initial: dict[str, torch.Tensor]) -> dict:
    from transformers import AutoModelForTokenClassification

    batch = make_batch(NUM_SAMPLES, seed=3)
    critic = AutoModelForTokenClassification.from_pretrained(
        model_dir, num_labels=1, dtype=torch.float32, attn_implementation="eager"
    )
    critic.load_state_dict(initial)
    critic.eval()  # no dropout: the critic is deterministic
    offsets = [0, *torch.cumsum(torch.from_numpy(batch.response_lengths), 0).tolist()]
    mask = [torch.from_numpy(batch.loss_masks[offsets[i] : offsets[i + 1]]) for i in range(NUM_SAMPLES)]
    with torch.no_grad():
        old_values = _values(critic, batch, list(range(NUM_SAMPLES)))
    opt = torch.optim.AdamW(critic.parameters(), lr=LR, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0)
    losses, clipfracs, grads = [], [], []
    for first in range(0, NUM_SAMPLES, STEP_SAMPLES):
        ids = list(range(first, first + STEP_SAMPLES))
        terms, clipped_terms = [], []
        for i, v in zip(ids, _values(critic, batch, ids), strict=True):
            v_old, ret, m = old_values[i], float(batch.rewards[i]), mask[i]
            v_clip = v_old + (v - v_old).clamp(-VALUE_CLIP, VALUE_CLIP)
            per_token = torch.maximum((v_clip - ret) ** 2, (v - ret) ** 2)
            terms.append((per_token * m).sum() / m.sum().clamp(min=1))
            clipped = ((v_clip - ret) ** 2 > (v - ret) ** 2).float()
            clipped_terms.append((clipped * m).sum() / m.sum().clamp(min=1))
        loss = torch.stack(terms).mean()
        opt.zero_grad()
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in critic.named_parameters()})
        losses.append(loss.item())
        clipfracs.append(torch.stack(clipped_terms).mean().item())
        opt.step()
    return {"losses": losses, "clipfracs": clipfracs, "grads": grads}


@pytest.fixture(scope="module")
def critic_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("critic")
    model_dir = make_tiny_model(str(root / "model"))
    run_ranks(_rank_fn, 2, model_dir, str(root))
    got = torch.load(root / "critic.pt", weights_only=False)
    return got, _reference(model_dir, got["initial"])


def test_value_loss_and_gradients_match_single_process(critic_run):
    got, ref = critic_run
    assert ref["clipfracs"][0] == 0.0 and 0.0 < ref["clipfracs"][1] < 1.0, "step 2 should clip part of the tokens"
    first = got["metrics"][0]
    assert first["train/value_loss"] == pytest.approx(sum(ref["losses"]) / 2, abs=1e-5, rel=1e-4)
    assert first["train/value_clipfrac"] == pytest.approx(sum(ref["clipfracs"]) / 2, abs=1e-6)
    assert len(got["grads"]) == 2
    for step, (g_got, g_ref) in enumerate(zip(got["grads"], ref["grads"], strict=True)):
        assert set(g_got) == set(g_ref)
        for name, g in g_ref.items():
            torch.testing.assert_close(g_got[name], g, atol=1e-5, rtol=1e-4, msg=f"step {step + 1}: grad of {name}")


def test_value_loss_decreases_over_train_calls(critic_run):
    got, _ = critic_run
    losses = [m["train/value_loss"] for m in got["metrics"]]
    assert all(b < a for a, b in zip(losses, losses[1:], strict=False)), f"value loss did not fall: {losses}"
    assert losses[-1] < 0.5 * losses[0], f"value loss fell too little: {losses}"
