"""--partial-rollout in the sync loop: groups still generating when a step has its groups are
aborted and carried to the next rollout with their tokens, log-probs and weight versions, and
resume from prompt + partial response; no prompt is trained twice. Without the flag, the aborted
groups' prompts go back empty, as before.

The rollout runs against an in-test router that holds chosen samples until the abort broadcast
(as an engine does: the request ends with its partial output and finish reason `abort`).
"""

from __future__ import annotations

import asyncio

import pytest

from miles.config import ConfigError, MilesConfig, load_config
from miles.controller.rollout_manager import SyncRolloutManager
from miles.rollout.sample import Sample, SampleStatus

N = 2  # samples per prompt
PARTIAL = [50, 51]  # what a held request has generated when it is aborted
FINISH = [7, 7, 7]  # what every request generates otherwise

REWARDED: list[int] = []


def count_rm(args, sample):
    REWARDED.append(sample.index)
    return 1.0


class HoldingRouter:
    """Holds the requests of the sample indices in `hold` until `abort_request`; versions tag tokens."""

    def __init__(self) -> None:
        self.version = 0
        self.hold: set[int] = set()
        self.payloads: list[dict] = []
        self._aborted = asyncio.Event()

    async def generate(self, payload):
        self.payloads.append(payload)
        index = payload["sampling_params"]["sampling_seed"]  # the manager's seed is 0: seed == sample index
        held = index in self.hold
        if held:
            await self._aborted.wait()
        else:
            await asyncio.sleep(0)
        ids, lp, finish = (PARTIAL, -0.5, "abort") if held else (FINISH, -0.1, "stop")
        return {
            "text": " ".join(map(str, ids)),
            "output_ids": list(ids),
            "meta_info": {
                "output_token_logprobs": [[lp, t] for t in ids],
                "output_token_weight_versions": [self.version] * len(ids),
                "finish_reason": {"type": finish},
            },
        }

    async def abort_all(self):
        self._aborted.set()

    def next_step(self, version: int, hold: set[int]) -> None:
        self.version, self.hold, self._aborted = version, hold, asyncio.Event()


class ListSource:
    """Group g has prompt [100 + g, 1, 2] and sample indices N*g .. N*g + N-1; handed-back groups first."""

    def __init__(self) -> None:
        self.next_group, self.buffer = 0, []

    def get_samples(self, k: int) -> list[list[Sample]]:
        out = [self.buffer.pop(0) for _ in range(min(k, len(self.buffer)))]
        while len(out) < k:
            g = self.next_group
            out.append([Sample(tokens=[100 + g, 1, 2], label="7", group_index=g, index=N * g + i) for i in range(N)])
            self.next_group += 1
        return out

    def add_samples(self, groups: list[list[Sample]]) -> None:
        self.buffer.extend(groups)


def _manager(partial: bool):
    cfg = MilesConfig()
    r = cfg.rollout
    r.rollout_batch_size, r.over_sampling_batch_size, r.n_samples_per_prompt = 2, 3, N
    r.partial_rollout = partial
    cfg.reward.custom_rm_path = f"{__name__}:count_rm"
    source, router = ListSource(), HoldingRouter()
    return SyncRolloutManager(cfg, router, source, tokenizer=None, seed=0), source, router


def _requests_for(router: HoldingRouter, index: int) -> list[dict]:
    return [p for p in router.payloads if p["sampling_params"]["sampling_seed"] == index]


async def _steps(partial: bool, holds: list[set[int]]):
    manager, source, router = _manager(partial)
    results = []
    for step, hold in enumerate(holds):
        router.next_step(version=step, hold=hold)
        results.append(await manager.generate(step))
    return results, source, router


def test_aborted_groups_resume_next_step_with_their_tokens_and_versions() -> None:
    REWARDED.clear()
    # step 0: groups 0, 1, 2; sample 4 (group 2) is held, its sibling 5 finishes; groups 0 and 1 are accepted
    # step 1: carried group 2 resumes, fresh groups 3 and 4 start; group 4 (samples 8, 9) is held
    # step 2: carried group 4 resumes, fresh groups 5 and 6 start
    results, source, router = asyncio.run(_steps(True, [{4}, {8, 9}, set()]))
    trained = [[g[0].group_index for g in r.groups] for r in results]
    assert trained[0] == [0, 1] and trained[1] == [2, 3] and trained[2][0] == 4
    flat = [g for step in trained for g in step]
    assert len(flat) == len(set(flat))  # every prompt trained at most once
    assert results[0].metrics["rollout/partial_groups_carried"] == 1.0

    # the held sample resumed from prompt + partial response, with the budget reduced by what it had
    first, resumed = _requests_for(router, 4)
    assert first["input_ids"] == [102, 1, 2] and resumed["input_ids"] == [102, 1, 2, *PARTIAL]
    assert resumed["sampling_params"]["max_new_tokens"] == first["sampling_params"]["max_new_tokens"] - len(PARTIAL)
    g2 = results[1].groups[0]
    s4, s5 = sorted(g2, key=lambda s: s.index)
    assert s4.tokens == [102, 1, 2, *PARTIAL, *FINISH] and s4.response_length == len(PARTIAL) + len(FINISH)
    assert s4.weight_versions == [0, 0, 1, 1, 1]  # which version produced which token
    assert s4.rollout_log_probs == pytest.approx([-0.5, -0.5, -0.1, -0.1, -0.1])
    assert (
        s4.loss_mask == [1] * 5 and s4.status == SampleStatus.COMPLETED and s4.response == "50 51" + "7 7 7"
    )  # texts joined as decoded
    assert s4.metadata["start_rollout_id"] == 0
    s4.validate()
    # its sibling finished in step 0: kept as it was, not generated or scored again
    assert len(_requests_for(router, 5)) == 1 and REWARDED.count(5) == 1
    assert s5.tokens == [102, 1, 2, *FINISH] and s5.weight_versions == [0, 0, 0]

    # a group held whole in step 1 resumes both samples in step 2
    for s in results[2].groups[0]:
        assert s.weight_versions == [1, 1, 2, 2, 2] and s.metadata["start_rollout_id"] == 1
    # what is left over after step 2 waits in the source for step 3, not trained yet
    left = [g[0].group_index for g in source.buffer]
    assert not set(left) & set(flat) and sorted(left + flat) == list(range(7))


def test_without_the_flag_aborted_groups_go_back_empty() -> None:
    results, source, router = asyncio.run(_steps(False, [{4}, set()]))
    assert "rollout/partial_groups_carried" not in results[0].metrics
    assert [g[0].group_index for g in results[1].groups][0] == 2
    first, again = _requests_for(router, 4)
    assert again["input_ids"] == first["input_ids"] == [102, 1, 2]  # generated afresh
    s4 = min(results[1].groups[0], key=lambda s: s.index)
    assert s4.tokens == [102, 1, 2, *FINISH] and s4.weight_versions == [1, 1, 1]
    assert len(_requests_for(router, 5)) == 2  # the finished sibling was thrown away and generated again


def test_partial_rollout_is_accepted_in_the_sync_loop_and_refused_with_fully_async() -> None:
    base = [
        "--hf-checkpoint",
        "/m",
        "--prompt-data",
        "/p.jsonl",
        "--rm-type",
        "math",
        "--num-rollout",
        "3",
        "--partial-rollout",
        "--rollout-batch-size",
        "4",
    ]
    assert load_config(base).rollout.partial_rollout
    with pytest.raises(ConfigError, match="--fully-async already keeps unfinished samples"):
        load_config([*base, "--fully-async"])
