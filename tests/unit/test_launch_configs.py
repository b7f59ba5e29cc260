"""Every config under launch/configs loads and passes the start-up rules, with the flags its documented commands
add; the GPU recipes run nowhere in CI, so a renamed flag or a new refusal would otherwise first show on a GPU."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles.config import load_config

CONFIGS = Path(__file__).resolve().parents[2] / "launch" / "configs"
# flags the recipes' documented commands add (docs/recipes.md, bench/results/gsm.md and fp8.md)
WITH = {
    "qwen25_gsm_1.5b_gpu.yaml": [["--max-tokens-per-gpu", "32768", "--offload-train", "--skip-eval-before-train"]],
    "smollm2_arith_gpu.yaml": [
        ["--colocate", "--fp32-residual-connection"],
        ["--colocate", "--fp32-residual-connection", "--sglang-quantization", "fp8", "--fp8-format", "e4m3"],
        ["--colocate", "--sglang-quantization", "fp8", "--tis-mode", "clip_or_pop"],
    ],
}


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_the_config_loads_as_written_and_with_its_documented_flags(name):
    for extra in [[], *WITH.get(name, [])]:
        cfg = load_config(["--config", str(CONFIGS / name), *extra])
        assert cfg.model.hf_checkpoint, (name, extra)


def test_every_config_with_documented_flags_exists():
    assert set(WITH) <= {p.name for p in CONFIGS.glob("*.yaml")}
