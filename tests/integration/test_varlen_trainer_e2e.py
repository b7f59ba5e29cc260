"""`--attn-implementation miles_varlen` end to end on CPU: the trainer packs each micro-batch into one row
with no padding and learns what the default (SDPA over padded rows) learns, step for step. The prompts
differ in length, so the packed rows really hold sequences of several lengths."""

from __future__ import annotations

import json
import math

from harness import SMALL_RUN, run_train

COMMON = (
    *SMALL_RUN,
    "--deterministic",
    "--num-rollout",
    "3",
    "--use-dynamic-batch-size",
    "--max-tokens-per-gpu",
    "96",
)
COMPARED = ("train/loss", "train/pg_loss", "train/grad_norm", "train/entropy", "rollout/reward_mean")
# The engine scores its samples with its own forward: the trainer's log-probs of them, packed or padded,
# agree with it to fp32 rounding (a sequence attending across its neighbours in the row would not).
ENGINE_AGREEMENT = 1e-5


def test_packed_rows_train_as_padded_rows(tmp_path):
    data = tmp_path / "prompts.jsonl"
    with open(data, "w") as f:
        for i in range(16):
            f.write(json.dumps({"input": "now " * (i % 5) + f"copy {i % 10} :", "label": str(i % 10)}) + "\n")
    flags = (*COMMON, "--prompt-data", str(data))
    padded = run_train(tmp_path / "padded", *flags)
    packed = run_train(tmp_path / "packed", *flags, "--attn-implementation", "miles_varlen")
    log = (tmp_path / "packed" / "logs" / "trainer_0.log").read_text()
    assert "trainer attention: miles_varlen (--attn-implementation)" in log
    assert "attn=miles_varlen" in log
    steps = [r for r in padded if r.get("step", -1) >= 0]
    assert len(steps) == 3
    for a, b in zip(steps, [r for r in packed if r.get("step", -1) >= 0], strict=True):
        for key in COMPARED:
            assert math.isclose(a[key], b[key], rel_tol=1e-5, abs_tol=1e-6), (a["step"], key, a[key], b[key])
        for row in (a, b):
            assert row["train/train_rollout_logprob_abs_diff"] < ENGINE_AGREEMENT, row
