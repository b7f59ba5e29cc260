"""SFT on CPU (`miles train --loss-type sft_loss`): no engine starts, the loss falls, and the exported
checkpoint starts an RL run that already answers far better than the base model.

The SFT run trains the demo's tiny model on launch/data/digit_copy_train.jsonl as prompt/response
pairs (the label is the response). The RL run (the CPU demo) starts from its HF export and
evaluates it greedily before its first step; the base model is scored the same way here, with the
embedded engine in-process, as the reference.
"""

from __future__ import annotations

import asyncio
import json

from e2e_helpers import REPO, leftover_processes, run_train

from miles.recipes.digit_copy import first_digit_reward

SFT_CONFIG = REPO / "launch" / "configs" / "demo_sft_cpu.yaml"
EVAL_DATA = REPO / "launch" / "data" / "digit_copy_eval.jsonl"


def _greedy_eval(model_dir: str, rows: list[dict]) -> float:
    from miles.engines.embedded.engine import EmbeddedEngine

    async def body() -> list[str]:
        engine = EmbeddedEngine(model_dir)
        await engine.start()
        try:
            params = {"temperature": 0.0, "max_new_tokens": 6}
            outs = await asyncio.gather(*(engine.generate(text=r["input"], sampling_params=params) for r in rows))
            return [o["text"] for o in outs]
        finally:
            await engine.shutdown()

    texts = asyncio.run(body())
    return sum(first_digit_reward(t, r["label"]) for t, r in zip(texts, rows, strict=True)) / len(rows)


def test_sft_loss_falls_without_engines_and_its_export_starts_an_rl_run(tmp_path):
    from miles.models.tiny import make_tiny_model

    # what the config's `tiny:qwen2:2x64` builds, here where the test can score it
    base_dir = make_tiny_model(
        str(tmp_path / "model"), arch="qwen2", layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, seed=1234
    )
    sft_out, hf = tmp_path / "sft", tmp_path / "hf"
    rows = run_train(
        sft_out,
        "--hf-checkpoint",
        base_dir,
        "--save-hf",  # without --save: the export alone
        str(hf),
        config=SFT_CONFIG,
    )
    assert not leftover_processes(str(sft_out))
    assert sorted(p.name for p in (sft_out / "logs").iterdir()) == ["trainer_0.log"]  # no engine was started
    losses = [r["train/loss"] for r in rows]
    assert len(losses) == 60 and all(r["sft/samples"] == 32 for r in rows)
    assert sum(losses[-4:]) / 4 < 0.5 * sum(losses[:4]) / 4, f"SFT loss did not fall: {losses}"

    rl_out = tmp_path / "rl"
    rl_rows = run_train(
        rl_out,
        "--hf-checkpoint",
        str(hf),
        "--num-rollout",
        "1",
        "--rollout-batch-size",
        "4",
        "--global-batch-size",
        "32",
        "--eval-interval",
        "1",
    )
    assert not leftover_processes(str(rl_out))
    sft_eval = rl_rows[0]["eval/digit_copy/reward_mean"]  # before the first RL step: the SFT'd model itself
    assert "rollout/reward_mean" in rl_rows[1] and "train/loss" in rl_rows[1]  # it trained a step

    eval_rows = [json.loads(line) for line in EVAL_DATA.read_text().splitlines() if line.strip()]
    base_eval = _greedy_eval(base_dir, eval_rows)
    assert sft_eval >= base_eval + 0.4, f"SFT'd model scores {sft_eval:.3f}, the base model {base_eval:.3f}"
