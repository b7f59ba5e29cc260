"""A whole run's controller never imports torch or transformers: on slow file systems each costs
seconds of start-up (the workers import them; the controller needs neither for a plain run)."""

from __future__ import annotations

import json
import subprocess
import sys

from harness import DEMO as CONFIG
from harness import REPO, installed


def test_a_demo_run_keeps_torch_and_transformers_out_of_the_controller(tmp_path):
    code = (
        "import sys, json\n"
        "from miles.cli import main\n"
        f"rc = main(['train', '--config', {str(CONFIG)!r}, '--eval-interval', '2', '--num-rollout', '2',"
        f" '--save', {str(tmp_path / 'ckpt')!r}, '--save-interval', '2', '--max-checkpoints', '1',"
        f" '--output-dir', {str(tmp_path / 'run')!r}, '--no-progress-bar'])\n"
        "print(json.dumps([rc, sorted(m for m in ('torch', 'transformers') if m in sys.modules)]))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [0, []]
    if installed("tensorboard"):  # the demo config asks for TensorBoard; without it the run says so and goes on
        assert (tmp_path / "run" / "tensorboard").is_dir()  # TensorBoard scalars written without torch
