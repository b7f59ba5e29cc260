"""The CPU demo task: read a digit in the prompt, answer with it.

A random tiny model emits a digit first only rarely, so the reward starts near zero; the task is
verifiable (the reward is an exact check) and a 2-layer model learns it in a few dozen RL steps,
which makes the reward curve climb clearly within minutes on a laptop CPU.
"""

from __future__ import annotations

import json
import os
import random


def make_prompts(path: str, num_prompts: int = 200, seed: int = 0) -> str:
    """Write `num_prompts` JSONL rows {"input": "copy 7 :", "label": "7"}."""
    rng = random.Random(seed)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        for _ in range(num_prompts):
            d = str(rng.randrange(10))
            f.write(json.dumps({"input": f"copy {d} :", "label": d}) + "\n")
    return path


def first_digit_reward(response: str, label: str) -> float:
    """1.0 when the response starts with the label digit, 0.25 when it starts with another digit, else 0.

    The partial credit for answering in the right form (a digit first) gives a random model a
    signal to climb from; only the right digit earns the full reward.
    """
    text = response.lstrip()
    if not text or not text[0].isdigit():
        return 0.0
    return 1.0 if text[0] == str(label).strip() else 0.25


async def reward(args, sample, **kwargs) -> float:
    """`--custom-rm-path miles.recipes.digit_copy.reward`."""
    return first_digit_reward(sample.response, sample.label)
