"""R3's routing through a sample's life: a reply, a resumed partial rollout, a debug dump, the train batch."""

import numpy as np
import torch

from miles.rollout.generate import apply_generate_output, extend_with_output
from miles.rollout.sample import Sample
from miles.rollout.train_data import samples_to_train_batch
from miles.utils.routing import RoutingShape, encode_sglang

SHAPE = RoutingShape(moe_layers=2, topk=2, num_experts=8)


def _reply(seq: list[int], new: list[int]) -> dict:
    routed = np.array([[[t % 8, (t + p) % 8]] * 2 for p, t in enumerate(seq[:-1])])
    meta = {"finish_reason": {"type": "abort"}, "output_token_logprobs": [[-0.5, t, None] for t in new]}
    return {"output_ids": new, "meta_info": {**meta, "routed_experts": encode_sglang(routed)}}


def test_a_resumed_partial_rollout_takes_the_routing_of_the_whole_sequence():
    s = Sample(index=0, group_index=0, reward=1.0)
    apply_generate_output(s, [1, 2, 3], _reply([1, 2, 3, 4, 5], [4, 5]), SHAPE)
    assert s.rollout_routed_experts.shape == (4, 2, 2) and s.rollout_routed_experts.dtype == np.uint8
    extend_with_output(s, _reply([1, 2, 3, 4, 5, 6, 7], [6, 7]), SHAPE)
    s.validate()
    assert s.rollout_routed_experts.shape == (6, 2, 2)
    assert s.rollout_routed_experts[5, 0].tolist() == [6 % 8, (6 + 5) % 8]


def test_routing_survives_a_debug_dump_and_lands_in_the_train_batch(tmp_path):
    samples = []
    for i, n in enumerate((3, 5)):
        s = Sample(index=i, group_index=0, reward=float(i), tokens=list(range(n)), response_length=1)
        s.rollout_routed_experts = np.full((n - 1, 2, 2), i + 1, np.uint8)
        samples.append(s)
    torch.save({"samples": [s.to_dict() for s in samples]}, tmp_path / "d.pt")
    back = [Sample.from_dict(d) for d in torch.load(tmp_path / "d.pt", weights_only=True)["samples"]]
    assert all(
        np.array_equal(a.rollout_routed_experts, b.rollout_routed_experts) for a, b in zip(samples, back, strict=True)
    )
    batch = samples_to_train_batch(
        back, reward_key=None, estimator="grpo", std_normalization=False, disable_rewards_normalization=True
    )
    assert batch.routed_experts.shape == (2 + 4, 2, 2) and batch.routed_experts.dtype == np.uint8
    picked = batch.select([1])
    assert picked.routed_experts.shape == (4, 2, 2) and (picked.routed_experts == 2).all()
    assert [r.shape[0] for r in batch.routed_per_sample()] == [2, 4]


def test_the_generate_body_passes_routed_experts_to_every_prompt():
    from miles.engines.sglang_protocol import parse_generate_body

    calls, batch = parse_generate_body(
        {"input_ids": [[1, 2], [3, 4, 5]], "return_routed_experts": True, "routed_experts_start_len": 1}
    )
    assert batch and [(c["return_routed_experts"], c["routed_experts_start_len"]) for c in calls] == [(True, 1)] * 2
    (plain,), _ = parse_generate_body({"input_ids": [1, 2]})
    assert "return_routed_experts" not in plain
