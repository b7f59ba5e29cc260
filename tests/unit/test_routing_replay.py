"""Routing replay on transformers' qwen3_moe router: the plain path is the router op for op; a replay uses the
given experts with the router's own probabilities (renormalised) and keeps its gradient."""

import numpy as np
import pytest
import torch

from miles.rollout.train_data import TrainBatch
from miles.trainer.packing import flat_token_positions
from miles.trainer.routing_replay import RoutingReplay, moe_routers
from miles.utils.routing import decode_sglang, encode_sglang, routing_bytes_per_token, routing_dtype

transformers = pytest.importorskip("transformers")


def _model():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
        intermediate_size=32, moe_intermediate_size=8, num_experts=6, num_experts_per_tok=2, norm_topk_prob=True,
    )  # fmt: skip
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(cfg).float().eval()


def _batch(seqs: list[list[int]], routed: list[np.ndarray] | None) -> TrainBatch:
    b = len(seqs)
    return TrainBatch(
        tokens=np.concatenate([np.asarray(s) for s in seqs]), seq_lens=np.array([len(s) for s in seqs]),
        response_lengths=np.ones(b, np.int64), loss_masks=np.ones(b, np.float32), rewards=np.zeros(b, np.float32),
        raw_rewards=np.zeros(b, np.float32), group_index=np.arange(b), sample_index=np.arange(b),
        truncated=np.zeros(b, np.int8), routed_experts=None if routed is None else np.concatenate(routed),
    )  # fmt: skip


def test_the_plain_path_is_the_hf_router_op_for_op():
    model = _model()
    x = torch.randn(7, 16)
    want = [r(x) for r in moe_routers(model)]
    replay = RoutingReplay(model, mode="rollout")
    for r, w in zip(replay.routers, want, strict=True):
        for a, b in zip(r(x), w, strict=True):
            assert torch.equal(a, b)


def test_a_replay_uses_the_given_experts_with_the_routers_probabilities_and_gradient():
    model = _model()
    seqs = [[1, 2, 3, 4], [5, 6, 7]]
    forced = [np.array([[[5, 0], [1, 2]]] * 3, np.uint8), np.array([[[3, 4], [0, 5]]] * 2, np.uint8)]
    batch = _batch(seqs, forced)
    replay = RoutingReplay(model, mode="rollout")
    router = replay.routers[1]
    seen = []
    router.register_forward_hook(lambda _m, inp, out: seen.append((inp[0].detach(), out)))
    with replay.scope(batch, "padded", first_pass=True):
        model(torch.tensor([[1, 2, 3, 4], [5, 6, 7, 0]]))
    hidden, (logits, weights, idx) = seen[0]
    idx = idx.view(2, 4, 2)
    assert idx[0, :3].tolist() == [[1, 2]] * 3 and idx[1, :2].tolist() == [[0, 5]] * 2
    probs = torch.softmax(logits.float(), -1).view(2, 4, -1)
    want = probs[1, 0, [0, 5]] / probs[1, 0, [0, 5]].sum()
    torch.testing.assert_close(weights.view(2, 4, 2)[1, 0], want)
    # the last token of each sequence (no recorded row) and the padding keep the router's own top-k
    own = torch.topk(probs, 2, -1).indices
    assert torch.equal(idx[0, 3], own[0, 3]) and torch.equal(idx[1, 2:], own[1, 2:])
    weights.sum().backward()
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
    assert replay.counts[0] == 5 and replay.counts[1] == 0  # 5 routed tokens, none used differently


def test_self_replay_records_the_first_pass_and_replays_it():
    model = _model()
    batch = _batch([[1, 2, 3, 4], [5, 6, 7, 8]], None)
    replay = RoutingReplay(model, mode="self")
    replay.begin_step()
    with torch.no_grad(), replay.scope(batch, "padded", first_pass=True):
        model(torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]]))
    assert sorted(replay.recorded) == [0, 1] and replay.recorded[0].shape == (3, 2, 2)
    replay.recorded[0][:] = 4  # what the second pass must now use for sample 0 (both of top-2 cannot be 4: set)
    replay.recorded[0][:, :, 1] = 3
    got = []
    replay.routers[0].register_forward_hook(lambda _m, _i, out: got.append(out[2]))
    with torch.no_grad(), replay.scope(batch, "padded", first_pass=False):
        model(torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]]))
    assert got[0].view(2, 4, 2)[0, :3].tolist() == [[4, 3]] * 3


def test_flat_positions_line_up_with_both_layouts():
    batch = _batch([[1, 2, 3], [4, 5]], None)
    assert [p.tolist() for p in flat_token_positions(batch, "padded")[1]] == [[0, 1, 2], [3, 4]]
    assert flat_token_positions(batch, "padded")[0] == 6
    assert [p.tolist() for p in flat_token_positions(batch, "row")[1]] == [[0, 1, 2], [3, 4]]


def test_routing_travels_in_a_quarter_of_the_int32_bytes_and_round_trips():
    assert routing_dtype(128) == np.uint8 and routing_dtype(256) == np.uint8 and routing_dtype(257) == np.uint16
    carried, int32 = routing_bytes_per_token(48, 8, 128)
    assert carried * 4 == int32 == 48 * 8 * 4
    routed = np.random.default_rng(0).integers(0, 128, (5, 3, 8))
    back = decode_sglang(encode_sglang(routed), 3, 8, 128)
    assert back.dtype == np.uint8 and np.array_equal(back, routed)
    with pytest.raises(ValueError, match="outside"):
        decode_sglang(encode_sglang(routed), 3, 8, 64)
