"""A group of fresh samples goes to the engine as one batched /generate call (SGLang's list form)."""

from __future__ import annotations

import asyncio

from miles.config import MilesConfig
from miles.controller.rollout_manager import SyncRolloutManager
from miles.rollout.sample import Sample, SampleStatus

N = 4


def seven_rm(args, sample):
    return float(sample.response == "7 7")


class BatchRouter:
    """Answers SGLang's batch form item by item: tokens [7, 7] (or [8] for odd seeds), logprob -0.25."""

    batched_generate = True
    session_mode = False

    def __init__(self) -> None:
        self.payloads: list[dict] = []

    async def generate(self, payload):
        self.payloads.append(payload)
        assert isinstance(payload["input_ids"][0], list), "a group is sent in the list form"
        outs = []
        for params, rid in zip(payload["sampling_params"], payload["rid"], strict=True):
            ids = [7, 7] if params["sampling_seed"] % 2 == 0 else [8]
            outs.append(
                {
                    "text": " ".join(map(str, ids)),
                    "output_ids": ids,
                    "meta_info": {
                        "id": rid,
                        "output_token_logprobs": [[-0.25, t, None] for t in ids],
                        "finish_reason": {"type": "stop"},
                    },
                }
            )
        return outs


class Source:
    def __init__(self) -> None:
        self.next_group = 0

    def get_samples(self, k: int) -> list[list[Sample]]:
        out = []
        for _ in range(k):
            g = self.next_group
            out.append([Sample(tokens=[100 + g, 1], label="7", group_index=g, index=N * g + i) for i in range(N)])
            self.next_group += 1
        return out

    def add_samples(self, groups):
        raise AssertionError("nothing is handed back in this test")


def test_a_group_is_one_batched_call_with_a_seed_and_rid_per_sample():
    cfg = MilesConfig()
    r = cfg.rollout
    r.rollout_batch_size, r.over_sampling_batch_size, r.n_samples_per_prompt = 2, 2, N
    cfg.reward.custom_rm_path = f"{__name__}:seven_rm"
    router = BatchRouter()
    manager = SyncRolloutManager(cfg, router, Source(), tokenizer=None, seed=0)
    result = asyncio.run(manager.generate(0))
    assert len(router.payloads) == 2  # one call per group, not one per sample
    for payload, group in zip(router.payloads, sorted(result.groups, key=lambda g: g[0].group_index), strict=True):
        assert payload["input_ids"] == [list(group[0].tokens[:2])] * N
        assert [p["sampling_seed"] for p in payload["sampling_params"]] == [s.index for s in group]
        assert payload["rid"] == [s.metadata["rid"] for s in group] and len(set(payload["rid"])) == N
    for group in result.groups:
        for s in group:
            even = s.index % 2 == 0
            assert s.tokens[2:] == ([7, 7] if even else [8]) and s.response_length == (2 if even else 1)
            assert s.rollout_log_probs == [-0.25] * s.response_length and s.loss_mask == [1] * s.response_length
            assert s.status == SampleStatus.COMPLETED and s.reward == (1.0 if even else 0.0)
