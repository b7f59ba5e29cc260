"""bench/e2e_vs_trl.py on CPU with a tiny model: both sides run and the summary line has every field.

No timing is asserted (the ratio on CPU is informative only); GPU figures: bench/results/e2e_vs_trl.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from e2e_helpers import REPO, python_path  # isort: skip

pytest.importorskip("trl")

FIELDS = (
    "job",
    "device",
    "miles_step_s",
    "trl_step_s",
    "ratio",
    "miles_startup_s",
    "trl_startup_s",
    "miles_reward_last5",
    "trl_reward_last5",
    "miles_phases",
    "trl_phases",
    "reward_last5_diff",
    "reward_last5_diff_mean",
    "reward_last5_diff_ci95",
)


@pytest.mark.timeout(900)
def test_both_sides_run_and_report(tmp_path):
    cmd = [
        sys.executable,
        "bench/e2e_vs_trl.py",
        "--job",
        "short",
        "--device",
        "cpu",
        "--steps",
        "2",
        "--prompts",
        "2",
        "--samples",
        "2",
        "--work-dir",
        str(tmp_path),
        "--timeout-s",
        "600",
    ]
    out = subprocess.run(
        cmd,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "MILES_TORCH_THREADS": "1", "PYTHONPATH": python_path()},
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    line = json.loads(out.stdout.strip().splitlines()[-1])
    for field in FIELDS:
        assert field in line, field
    assert line["miles_step_s"] > 0 and line["trl_step_s"] > 0 and line["miles_startup_s"] > 0
    assert {"generate", "train", "update_weights"} <= set(line["miles_phases"])
