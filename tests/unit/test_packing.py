"""Micro-batch planning and packing: every token exactly once, budgets respected, positions restart."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from harness import make_train_batch

from miles.trainer.packing import (
    fixed_micro_batches,
    pack_sequences,
    plan_micro_batches,
    token_budget_micro_batches,
)


def _batch(seq_lens: list[int], resp_lens: list[int], seed: int = 0):
    return make_train_batch(seq_lens, resp_lens, seed=seed)


def test_fixed_micro_batches_cover_in_order():
    assert fixed_micro_batches(5, 2) == [[0, 1], [2, 3], [4]]
    with pytest.raises(ValueError, match="micro_batch_size=0"):
        fixed_micro_batches(3, 0)


@pytest.mark.parametrize("seed", range(5))
def test_token_budget_every_sample_once_and_within_budget(seed):
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, 50, size=40)
    budget = 64
    bins = token_budget_micro_batches(lens, budget)
    flat = sorted(i for b in bins for i in b)
    assert flat == list(range(40))  # every sample (hence every token) exactly once
    assert all(sum(lens[i] for i in b) <= budget for b in bins)
    # first-fit decreasing never needs more than ~11/9 OPT + 1 bins; a lower bound check is the token total
    assert len(bins) >= int(np.ceil(lens.sum() / budget))
    assert len(bins) <= int(np.ceil(11 / 9 * np.ceil(lens.sum() / budget))) + 1


def test_overlong_sequence_gets_own_bin():
    bins = token_budget_micro_batches([10, 100, 5], 20)
    assert [1] in bins and sorted(i for b in bins for i in b) == [0, 1, 2]


def test_plan_requires_budget_with_dynamic():
    with pytest.raises(ValueError, match="max-tokens-per-gpu"):
        plan_micro_batches([3, 4], micro_batch_size=1, use_dynamic_batch_size=True, max_tokens_per_gpu=None)


def test_packed_row_positions_restart_and_targets_are_response_tokens():
    b = _batch([5, 3, 4], [2, 1, 3])
    p = pack_sequences(b)
    assert p.input_ids.shape == (1, 12)
    assert p.position_ids[0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3]
    seqs = b.sequences()
    expected_targets = np.concatenate([seqs[0][-2:], seqs[1][-1:], seqs[2][-3:]])
    assert p.targets.tolist() == expected_targets.tolist()
    # logits at row position k predict token k+1: hand-computed positions 2,3 | 6 | 8,9,10
    assert p.logits_index.tolist() == [2, 3, 6, 8, 9, 10]
    assert p.num_tokens == 12


def test_equal_lengths_use_rectangle_and_gather_same_tokens():
    b = _batch([4, 4], [1, 3])
    p = pack_sequences(b)
    assert p.input_ids.shape == (2, 4)
    assert p.position_ids.tolist() == [[0, 1, 2, 3]] * 2
    # a fake "logits" grid [rows, kept positions] holding the absolute predicting position
    grid = p.logits_index.unsqueeze(0).expand(2, -1) + torch.tensor([[0], [100]])
    picked = grid[p.gather_rows, p.gather_cols].tolist()
    assert picked == [2, 100, 101, 102]  # sample 0 predicts pos 3 from 2; sample 1 pos 1..3 from 0..2
    seqs = b.sequences()
    assert p.targets.tolist() == [seqs[0][3], *seqs[1][1:]]


def test_rejects_sample_without_prompt_token():
    with pytest.raises(ValueError, match="response_length=3"):
        pack_sequences(_batch([3], [3]))


def test_padded_layout_right_pads_and_gathers_each_response():
    b = _batch([5, 3, 4], [2, 1, 3])
    p = pack_sequences(b, "padded")
    assert p.input_ids.shape == (3, 5) and p.num_tokens == 15
    seqs = b.sequences()
    for i, seq in enumerate(seqs):
        assert p.input_ids[i, : len(seq)].tolist() == seq.tolist()
    # a fake "logits" grid [rows, kept positions] holding (row, absolute predicting position)
    grid = p.logits_index.unsqueeze(0).expand(3, -1) + 100 * torch.arange(3).unsqueeze(1)
    picked = grid[p.gather_rows, p.gather_cols].tolist()
    assert picked == [2, 3, 101, 200, 201, 202]  # position k predicts token k + 1
    assert p.targets.tolist() == np.concatenate([seqs[0][-2:], seqs[1][-1:], seqs[2][-3:]]).tolist()


@pytest.mark.parametrize("seed", range(3))
def test_padded_budget_counts_padding_and_groups_similar_lengths(seed):
    lens = np.random.default_rng(seed).integers(1, 50, size=60)
    bins = token_budget_micro_batches(lens, 128, padded=True)
    assert sorted(i for b in bins for i in b) == list(range(60))
    assert all(len(b) * max(lens[i] for i in b) <= 128 for b in bins)
    padded = sum(len(b) * max(lens[i] for i in b) for b in bins)
    assert padded <= 1.25 * lens.sum()  # longest-first bins hold neighbours in length: little padding


def test_padded_and_row_layouts_give_the_same_log_probs(tmp_path):
    from transformers import AutoModelForCausalLM

    from miles.models.tiny import make_tiny_model
    from miles.trainer.forward import response_logits

    path = make_tiny_model(
        str(tmp_path / "m"), arch="llama", layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128
    )
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    b = _batch([9, 5, 12, 7], [3, 1, 6, 2])
    b.tokens = b.tokens % 300
    with torch.no_grad():
        row, padded = (response_logits(model, pack_sequences(b, layout)) for layout in ("row", "padded"))
    torch.testing.assert_close(padded, row, rtol=1e-5, atol=1e-5)
