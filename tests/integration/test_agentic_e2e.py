"""Each plug-in layer drives a short `miles train` run on CPU: the calculator environment, tiny model.

The random tiny model almost never calls the tool or answers, so most episodes run to the turn
limit: model turn, reminder (a user turn), model turn, reminder, model turn. Many stop ids end
each turn after a few tokens, so the turns are short and the reminders are most of the response.
The checks: every step trained, the samples are multi-turn, only the model's tokens are trained
on, and the trainer's log-probs line up with the engine's on exactly those tokens (a mask shifted
by one token would compare log-probs of different tokens).
"""

from __future__ import annotations

import math
import subprocess
from pathlib import Path

import pytest

from e2e_helpers import REPO, run_train, train_command  # isort: skip  (same folder, rootdir on sys.path)

TURNS = 3
CALCULATOR = [
    "--prompt-data", "launch/data/calculator_train.jsonl", "--input-key", "messages", "--label-key", "label",
    "--num-rollout", "2", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--global-batch-size", "4",
    "--rollout-max-response-len", "8", "--generate-max-turns", str(TURNS), "--eval-interval", "0",
    "--rollout-stop-token-ids", *map(str, range(3, 200)),
]  # fmt: skip
ENV = "miles.agent.envs.calculator"
LAYERS = {
    "agent": ["--custom-agent-function-path", f"{ENV}.agent", "--use-session-server", "--tito-model", "chatml",
              "--custom-rm-path", f"{ENV}.reward"],
    "generate": ["--custom-generate-function-path", f"{ENV}.generate", "--custom-rm-path", f"{ENV}.reward"],
    "rollout": ["--rollout-function-path", f"{ENV}.CalculatorRollout"],
}  # fmt: skip


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_each_layer_runs_multi_turn_episodes_end_to_end(tmp_path: Path, layer: str):
    rows = run_train(tmp_path / layer, *CALCULATOR, *LAYERS[layer])
    assert [r["step"] for r in rows] == [0, 1]
    for row in rows:
        # a reply that happens to be a lone digit is an answer and ends its episode early
        assert 1.5 < row["rollout/turns_mean"] <= TURNS and row["rollout/turns_max"] == TURNS
        assert 0.0 < row["rollout/model_token_frac"] < 0.5  # reminders are most of each response, masked
        assert row["train/train_rollout_logprob_abs_diff"] < 1e-3
        assert math.isfinite(row["train/loss"])
    if layer == "rollout":
        assert rows[0]["rollout/calculator/turns_mean"] == rows[0]["rollout/turns_mean"]  # its own metrics, logged


def test_a_bad_agent_function_stops_the_run_before_any_worker_starts(tmp_path: Path):
    out = tmp_path / "bad"
    cmd = train_command(
        out,
        *CALCULATOR,
        "--custom-agent-function-path",
        f"{ENV}.calculate",
        "--use-session-server",
        "--tito-model",
        "chatml",
    )
    proc = subprocess.run(
        cmd,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"--custom-agent-function-path '{ENV}.calculate'" in proc.stderr
    assert "async def agent(base_url, prompt, request_kwargs, metadata" in proc.stderr
    assert not (out / "logs").exists()  # refused before any worker was spawned
