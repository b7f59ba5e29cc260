"""FSDP backend on 2 gloo ranks against an independent single-process reference.

The reference is written here from the formulas (plain HF model, one sequence per forward,
torch autograd): GRPO policy loss at the first step (ratio 1), an entropy bonus and a k1 KL term
against a reference model equal to the initial policy, aggregated as the mean over samples of
each sample's masked token mean. Tolerance: fp32 on CPU, only summation order differs, so
|Δ| <= 1e-5 absolute (+1e-4 relative) for losses, log-probs and every (clipped) gradient element.
"""

from __future__ import annotations

import os

import pytest
import torch

from _trainer_harness import configs, full_grads, make_batch, make_tiny_model, run_ranks, shard  # isort: skip

TEMPERATURE = 0.7
ENTROPY_COEF = 0.01
KL_COEF = 0.1
NUM_SAMPLES = 8
CLIP = 0.5  # below the step's grad norm, so clipping is exercised
ALGO = dict(
    advantage_estimator="grpo", entropy_coef=ENTROPY_COEF, use_kl_loss=True, kl_loss_coef=KL_COEF, kl_loss_type="k1"
)
VARIANTS = {
    "unpacked": {"micro_batch_size": 1},
    "fixed2": {"micro_batch_size": 2},
    "packed": {"use_dynamic_batch_size": True, "max_tokens_per_gpu": 40},
}


def _rank_fn(rank: int, world: int, model_dir: str, out_dir: str) -> None:
    from miles.trainer.backend import create_backend
    from miles.trainer.packing import token_budget_micro_batches

    batch = make_batch(NUM_SAMPLES, seed=1)
    local = shard(batch, rank, world, per_step=NUM_SAMPLES)
    results = {}
    for name, train in VARIANTS.items():
        be = create_backend(
            "fsdp",
            **configs(
                model_dir,
                algo=ALGO,
                train={**train, "clip_grad": CLIP},
                rollout={"global_batch_size": NUM_SAMPLES, "rollout_temperature": TEMPERATURE},
            ),
        )
        be.setup()
        log_probs, entropy = be.compute_log_probs(local, "actor")
        captured = {}
        step = be.optimizer.step

        def capture_then_step(*a, _step=step, _be=be, _out=captured, **kw):
            _out.update(full_grads(_be.actor))
            return _step(*a, **kw)

        be.optimizer.step = capture_then_step
        metrics = be.train(local, rollout_id=0)
        results[name] = {
            "metrics": metrics,
            "grads": captured,
            "log_probs": torch.from_numpy(log_probs),
            "entropy": torch.from_numpy(entropy),
        }
        if name == "packed":
            bins = token_budget_micro_batches(local.seq_lens, 40)
            results[name]["max_seqs_per_micro_batch"] = max(len(b) for b in bins)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def _reference(model_dir: str, batch) -> dict:
    """Single process: per-sequence forwards, the step loss from its formula, autograd gradients."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    sample_terms, log_probs, entropies = [], [], []
    mask_all = torch.from_numpy(batch.loss_masks)
    offset = 0
    for i, seq in enumerate(batch.sequences()):
        r = int(batch.response_lengths[i])
        ids = torch.from_numpy(seq).unsqueeze(0)
        logits = model(input_ids=ids).logits[0, -r - 1 : -1].float() / TEMPERATURE
        logp_all = torch.log_softmax(logits, -1)
        lp = logp_all.gather(-1, ids[0, -r:].unsqueeze(-1)).squeeze(-1)
        ent = -(logp_all.exp() * logp_all).sum(-1)
        m = mask_all[offset : offset + r]
        offset += r
        adv = float(batch.rewards[i])
        ratio = torch.exp(lp - lp.detach())
        per_token = -ratio * adv - ENTROPY_COEF * ent + KL_COEF * (lp - lp.detach())
        sample_terms.append((per_token * m).sum() / m.sum().clamp(min=1))
        log_probs.append(lp.detach())
        entropies.append(ent.detach())
    loss = torch.stack(sample_terms).mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values())).item()
    assert norm > CLIP, "the test batch should need clipping"
    scale = min(1.0, CLIP / (norm + 1e-6))
    return {
        "loss": loss.item(),
        "grad_norm": norm,
        "grads": {n: g * scale for n, g in grads.items()},
        "log_probs": torch.cat(log_probs),
        "entropy": torch.cat(entropies),
    }


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp")
    model_dir = make_tiny_model(str(root / "model"))
    run_ranks(_rank_fn, 2, model_dir, str(root))
    ranks = [torch.load(root / f"rank{r}.pt", weights_only=False) for r in range(2)]
    return ranks, _reference(model_dir, make_batch(NUM_SAMPLES, seed=1))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_loss_and_gradients_match_single_process(two_rank_results, variant):
    ranks, ref = two_rank_results
    got = ranks[0][variant]
    assert got["metrics"]["train/loss"] == pytest.approx(ref["loss"], abs=1e-5, rel=1e-4)
    assert set(got["grads"]) == set(ref["grads"])
    for name, g in ref["grads"].items():
        torch.testing.assert_close(got["grads"][name], g, atol=1e-5, rtol=1e-4, msg=f"gradient of {name}")
    # rank 1 holds the same full gradients (gathered), i.e. the DP sum really is global
    for name, g in ranks[1][variant]["grads"].items():
        torch.testing.assert_close(g, got["grads"][name], atol=0, rtol=0)


def test_packed_equals_unpacked_and_packs_several_sequences(two_rank_results):
    ranks, _ = two_rank_results
    assert ranks[0]["packed"]["max_seqs_per_micro_batch"] >= 2  # the packed path really packed
    for r in range(2):
        assert ranks[r]["packed"]["metrics"]["train/loss"] == pytest.approx(
            ranks[r]["unpacked"]["metrics"]["train/loss"], abs=1e-6
        )


def test_log_probs_and_entropy_match_reference(two_rank_results):
    ranks, ref = two_rank_results
    batch = make_batch(NUM_SAMPLES, seed=1)
    n0 = int(shard(batch, 0, 2, NUM_SAMPLES).response_lengths.sum())
    for variant in VARIANTS:
        lp = torch.cat([ranks[0][variant]["log_probs"], ranks[1][variant]["log_probs"]])
        ent = torch.cat([ranks[0][variant]["entropy"], ranks[1][variant]["entropy"]])
        assert lp.shape == ref["log_probs"].shape and ranks[0][variant]["log_probs"].numel() == n0
        torch.testing.assert_close(lp, ref["log_probs"], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ent, ref["entropy"], atol=1e-5, rtol=1e-5)


def test_step_metrics_present(two_rank_results):
    ranks, ref = two_rank_results
    m = ranks[0]["unpacked"]["metrics"]
    for key in (
        "train/grad_norm",
        "train/lr",
        "train/pg_clipfrac",
        "train/kl_loss",
        "train/entropy",
        "train/train_rollout_logprob_abs_diff",
        "train/train_rollout_kl",
        "perf/train_tokens_per_s",
        "perf/peak_mem_gb",
    ):
        assert key in m, key
    assert m["train/grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)  # reported before clipping
    assert m["train/kl_loss"] == pytest.approx(0.0, abs=1e-6)  # ref model == initial policy
