"""Colocated offload by default only when the trainer does not fit beside the engines."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import pytest
import torch

from miles.controller.offload import resolve_offload
from miles.trainer.memory_plan import activation_bytes, micro_batch_tokens, pending_state_bytes


def test_pending_state_is_grads_and_two_moments_until_allocated():
    model = torch.nn.Linear(10, 10)  # 110 fp32 parameters
    opt = torch.optim.AdamW(model.parameters())
    assert pending_state_bytes(model, opt) == 3 * 110 * 4
    model(torch.ones(1, 10)).sum().backward()
    opt.step()
    assert pending_state_bytes(model, opt) == 0


def test_activation_estimate_grows_with_tokens_and_shrinks_with_checkpointing():
    config = SimpleNamespace(hidden_size=576, num_hidden_layers=30, vocab_size=49152)
    full = activation_bytes(config, 16384, checkpointing=False)
    assert full == 16384 * (30 * 34 * 576 + 10 * 49152)
    assert activation_bytes(config, 8192, checkpointing=False) * 2 == full
    assert activation_bytes(config, 16384, checkpointing=True) < full


def test_micro_batch_tokens_is_the_dynamic_budget_or_size_times_the_longest_sample():
    rollout = SimpleNamespace(rollout_max_prompt_len=100, rollout_max_response_len=None)
    dynamic = SimpleNamespace(use_dynamic_batch_size=True, max_tokens_per_gpu=16384, micro_batch_size=4)
    fixed = SimpleNamespace(use_dynamic_batch_size=False, max_tokens_per_gpu=16384, micro_batch_size=4)
    assert micro_batch_tokens(dynamic, rollout) == 16384
    assert micro_batch_tokens(fixed, rollout) == 4 * (100 + 2048)


class _Trainers:
    def __init__(self, plans):
        self.plans = plans

    async def memory_plan(self):
        return self.plans


def _plan(fits: bool) -> dict:
    return {"total_bytes": 100, "free_bytes": 80, "pending_state_bytes": 10, "activation_bytes": 10, "fits": fits}


@pytest.mark.parametrize(
    ("plans", "expected"),
    [([_plan(True), _plan(True)], False), ([_plan(True), _plan(False)], True), ([None], True)],
)
def test_default_offload_is_off_only_when_every_rank_fits(plans, expected):
    cfg = SimpleNamespace(train=SimpleNamespace(offload_train=None, offload_rollout=None))
    asyncio.run(resolve_offload(cfg, _Trainers(plans), "cuda"))
    assert (cfg.train.offload_train, cfg.train.offload_rollout) == (expected, expected)


def test_flags_the_user_set_are_kept(caplog):
    cfg = SimpleNamespace(train=SimpleNamespace(offload_train=True, offload_rollout=None))
    with caplog.at_level(logging.INFO, logger="miles.controller.offload"):
        asyncio.run(resolve_offload(cfg, _Trainers([_plan(True)]), "cuda"))
    assert (cfg.train.offload_train, cfg.train.offload_rollout) == (True, False)
    # the log says what was decided, not "offload off" while the trainer's flag keeps it on
    assert "--offload-train on (as set), --offload-rollout off" in caplog.text


def test_host_buffers_are_reused_between_offloads_and_keep_the_newest_values():
    from miles.trainer.offload import HostOffloader

    tensors = [torch.arange(6, dtype=torch.float32), torch.ones(3, dtype=torch.bfloat16)]
    off = HostOffloader("t")
    off.offload(tensors)
    first = [h.data_ptr() for _, h in off._saved]
    off.onload()
    tensors[0].add_(1.0)  # trained in between: the next offload must carry the new values
    off.offload(tensors)
    assert [h.data_ptr() for _, h in off._saved] == first
    off.onload()
    assert tensors[0].tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0] and tensors[1].tolist() == [1.0] * 3


GIB = 2**30


def _h100_plan(tokens: int = 32768) -> dict:
    """The 0.5B GSM recipe's start-up plan on an 80 GB GPU (7.0 GiB of state pending, 68.7 GiB of activations
    estimated at 32,768 tokens), with 5 GiB held by the trainer."""
    acts = int(68.7 * GIB * tokens / 32768)
    return {"total_bytes": int(79.2 * GIB), "free_bytes": int(68.7 * GIB), "pending_state_bytes": 7 * GIB,
            "activation_bytes": acts, "fits": False, "resident_bytes": 5 * GIB, "tokens": tokens,
            "headroom_bytes": int(7.92 * GIB)}  # fmt: skip


def test_offload_that_cannot_make_room_for_the_activations_names_the_budget_that_would():
    from miles.controller.offload import tokens_that_fit_offloaded

    fit = tokens_that_fit_offloaded(_h100_plan())
    assert fit == 27 * 1024  # (79.2 - 7.92 - 5 - 7) GiB over 68.7 GiB / 32,768 tokens: 28,275, in whole 1,024s
    assert tokens_that_fit_offloaded(_h100_plan(16384)) is None  # the half budget fits
    assert tokens_that_fit_offloaded({**_h100_plan(), "tokens": 0}) is None  # a plan that cannot tell


def test_start_up_warns_when_offload_is_not_enough(caplog):
    cfg = SimpleNamespace(train=SimpleNamespace(offload_train=None, offload_rollout=None))
    with caplog.at_level("WARNING", logger="miles.controller.offload"):
        asyncio.run(resolve_offload(cfg, _Trainers([_h100_plan()]), "cuda"))
    assert cfg.train.offload_train and cfg.train.offload_rollout
    assert "--max-tokens-per-gpu 27648" in caplog.text
    caplog.clear()
    cfg = SimpleNamespace(train=SimpleNamespace(offload_train=None, offload_rollout=None))
    with caplog.at_level("WARNING", logger="miles.controller.offload"):
        asyncio.run(resolve_offload(cfg, _Trainers([_h100_plan(16384)]), "cuda"))
    assert "--max-tokens-per-gpu" not in caplog.text


def test_start_up_says_when_the_state_alone_leaves_no_room(caplog):
    cfg = SimpleNamespace(train=SimpleNamespace(offload_train=None, offload_rollout=None))
    crowded = {**_h100_plan(), "pending_state_bytes": 70 * GIB}
    with caplog.at_level("WARNING", logger="miles.controller.offload"):
        asyncio.run(resolve_offload(cfg, _Trainers([crowded]), "cuda"))
    assert "leaves no room" in caplog.text and "--max-tokens-per-gpu 0" not in caplog.text


def test_module_onloaded_brings_an_offloaded_module_back_for_the_body_only():
    """The reference model's context, shared by the FSDP and megatron backends: onloaded for the body with its
    values, back off the device after it (the hook first), also when the body raises; no offloader, body only."""
    from miles.trainer.offload import HostOffloader, module_onloaded, module_tensors

    ref = torch.nn.Linear(4, 3)
    want = ref.weight.detach().clone()
    off = HostOffloader("ref")
    off.offload(module_tensors(ref))
    assert ref.weight.untyped_storage().nbytes() == 0
    hooks = []
    with module_onloaded(off, ref, before_offload=lambda: hooks.append(ref.weight.untyped_storage().nbytes())):
        assert torch.equal(ref.weight, want)
    assert hooks == [want.numel() * 4] and ref.weight.untyped_storage().nbytes() == 0
    with pytest.raises(ValueError), module_onloaded(off, ref):
        raise ValueError("the forward failed")
    assert ref.weight.untyped_storage().nbytes() == 0 and off.is_offloaded
    with module_onloaded(None, ref):  # no offloader given: nothing is brought back
        assert ref.weight.untyped_storage().nbytes() == 0
