"""--true-on-policy-mode on CPU: the engine's re-scoring and the trainer's log-probs agree bit for bit.

Per architecture the embedded engine serves: the engine samples, re-scores by prefill through its
reference model, and the trainer's forward (`forward_sequences`, the path FSDP takes in this mode, both
without and with autograd) must return the very same float32 values, before and after a weight update
reaches the engine. Then the CPU demo in this mode: `train/train_rollout_logprob_abs_diff` is exactly 0
at every step (and the first optimizer step's ratio is exactly 1: `train/ppo_kl` is 0), with LoRA too where the
trainer computes on the merged weight (`--lora-merged-forward`). The reference
copies are also released (as `--offload-rollout` does on a GPU) and allocated again in between.
"""

from __future__ import annotations

import asyncio
import importlib.util

import numpy as np
import pytest
import torch
from e2e_helpers import run_train

from miles.engines.embedded.engine import EmbeddedEngine
from miles.models.tiny import make_tiny_model
from miles.rollout.train_data import TrainBatch
from miles.trainer.fsdp_shard import own_parameters
from miles.trainer.hf_io import load_causal_lm
from miles.trainer.true_on_policy import forward_sequences
from miles.true_on_policy import ATTN_IMPLEMENTATION

torch.set_num_threads(2)  # the reference forward pins its own thread count; the rest may differ
T = 0.8
PROMPTS = [[5, 6], [7, 8, 9], [10, 11, 12, 13], [14]]


async def rollouts(engine: EmbeddedEngine) -> list[tuple[list[int], int, list[float], list[float]]]:
    """(tokens, prompt length, decode log-probs, re-scored log-probs) of one sample per prompt."""
    out = []
    for i, prompt in enumerate(PROMPTS):
        gen = await engine.generate(
            input_ids=prompt,
            return_logprob=True,
            sampling_params={"temperature": T, "max_new_tokens": 6 + i, "ignore_eos": True, "sampling_seed": i},
        )
        ids = prompt + gen["output_ids"]
        scored = await engine.generate(
            input_ids=ids,
            return_logprob=True,
            logprob_start_len=len(prompt),
            sampling_params={"temperature": T, "max_new_tokens": 0},
        )
        decode = [e[0] for e in gen["meta_info"]["output_token_logprobs"]]
        out.append((ids, len(prompt), decode, [e[0] for e in scored["meta_info"]["input_token_logprobs"]]))
    return out


def batch_of(samples) -> TrainBatch:
    n_resp = [len(ids) - p for ids, p, _, _ in samples]
    z = np.zeros(len(samples))
    return TrainBatch(
        tokens=np.concatenate([np.array(ids) for ids, *_ in samples]),
        seq_lens=np.array([len(ids) for ids, *_ in samples]),
        response_lengths=np.array(n_resp),
        loss_masks=np.ones(sum(n_resp), np.float32),
        rewards=z.astype(np.float32),
        raw_rewards=z.astype(np.float32),
        group_index=z.astype(np.int64),
        sample_index=np.arange(len(samples)),
        truncated=z.astype(np.int8),
    )


def checkpoint_names(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF module tensors under the checkpoint's names the engine loads: transformers fuses a MoE layer's
    experts into `experts.gate_up_proj` [E, 2I, D] and `experts.down_proj` [E, D, I]."""
    out = {}
    for name, t in named.items():
        prefix, _, leaf = name.rpartition(".")
        if leaf == "gate_up_proj":
            gate, up = t.chunk(2, dim=1)
            out.update({f"{prefix}.{e}.gate_proj.weight": gate[e] for e in range(t.shape[0])})
            out.update({f"{prefix}.{e}.up_proj.weight": up[e] for e in range(t.shape[0])})
        elif leaf == "down_proj" and prefix.endswith("experts"):
            out.update({f"{prefix}.{e}.down_proj.weight": t[e] for e in range(t.shape[0])})
        else:
            out[name] = t
    return out


def trainer_log_probs(model: torch.nn.Module, samples) -> tuple[np.ndarray, np.ndarray]:
    """(no-grad, grad-enabled) log-probs of the trainer's true-on-policy forward."""
    batch, cpu = batch_of(samples), torch.device("cpu")
    with torch.no_grad():
        old, _, _ = forward_sequences(model.eval(), batch, cpu, T, entropy="detached")
    new, _, _ = forward_sequences(model.train(), batch, cpu, T, entropy="grad")
    return old.numpy(), new.detach().numpy()


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3", "qwen3_moe"])
def test_engine_rescoring_equals_the_trainer_bit_for_bit(tmp_path, arch):
    path = make_tiny_model(str(tmp_path / arch), arch=arch, init_std=0.2, seed=0)
    trainer = own_parameters(load_causal_lm(path, attn_implementation=ATTN_IMPLEMENTATION))
    update = {n: p.detach() + 0.01 * torch.randn_like(p) for n, p in trainer.named_parameters()}

    async def main():
        engine = EmbeddedEngine(path, true_on_policy=True)
        await engine.start()
        try:
            before = await rollouts(engine)
            engine.load_weights(checkpoint_names(update).items())  # a weight push: the reference copies follow
            engine.reference.release()  # as --offload-rollout on a GPU does: the next scoring allocates afresh
            return before, await rollouts(engine)
        finally:
            await engine.shutdown()

    before, after = asyncio.run(main())
    for samples, weights in ((before, None), (after, update)):
        if weights is not None:
            with torch.no_grad():
                for n, p in trainer.named_parameters():
                    p.copy_(weights[n])
        engine_lp = np.array([x for *_, rescored in samples for x in rescored], np.float32)
        old, new = trainer_log_probs(trainer, samples)
        assert np.array_equal(old, engine_lp), f"{arch}: max |d| {np.abs(old - engine_lp).max()}"
        assert np.array_equal(new, engine_lp), (
            f"{arch}: the grad pass differs, max |d| {np.abs(new - engine_lp).max()}"
        )
        decode = np.array([x for _, _, dec, _ in samples for x in dec], np.float32)
        assert not np.array_equal(decode, engine_lp)  # the engine's own kernels alone would not agree


def test_demo_logprob_diff_is_exactly_zero(tmp_path):
    rows = run_train(tmp_path / "run", "--true-on-policy-mode", "--num-rollout", "3", "--eval-interval", "0")
    steps = [r for r in rows if "train/train_rollout_logprob_abs_diff" in r]
    assert [r["step"] for r in steps] == [0, 1, 2]
    assert [r["train/train_rollout_logprob_abs_diff"] for r in steps] == [0.0, 0.0, 0.0]
    assert [r["train/ppo_kl"] for r in steps] == [0.0, 0.0, 0.0]
    assert steps[-1]["rollout/weight_version"] == 3.0  # the trainer's updates reached the engine every step


@pytest.mark.skipif(not importlib.util.find_spec("peft"), reason="needs peft (the lora extra)")
def test_a_lora_run_computing_on_the_merged_weight_is_exactly_on_policy(tmp_path):
    """The engine re-scores with the adapter merged into its weights; with --lora-merged-forward the trainer's
    adapted layers form that same weight, so a bf16 LoRA run is bit-exact too (without it: ~1e-7 in fp32)."""
    lora = ("--lora-rank", "4", "--lora-alpha", "16", "--lr", "0.02", "--lora-merged-forward", "--dtype", "bfloat16")
    rows = run_train(tmp_path / "run", "--true-on-policy-mode", "--num-rollout", "3", "--eval-interval", "0", *lora)
    steps = [r for r in rows if "train/train_rollout_logprob_abs_diff" in r]
    assert [r["train/train_rollout_logprob_abs_diff"] for r in steps] == [0.0, 0.0, 0.0]
    assert steps[-1]["rollout/weight_version"] == 3.0
