"""Start-up: `miles train` reaches the point where it spawns the workers without importing torch or
transformers (seconds each on slow file systems); the tokenizer is loaded while the workers start."""

from __future__ import annotations

import json
import subprocess
import sys


def test_the_controller_spawns_workers_before_importing_torch_or_transformers():
    code = (
        "import sys, json\n"
        "import miles.cli, miles.config, miles.controller.preflight, miles.models.resolve\n"
        "import miles.controller.placement, miles.controller.machine\n"
        "import miles.controller.loop_sync, miles.controller.loop_async, miles.controller.run\n"
        "print(json.dumps(sorted(m for m in ('torch', 'transformers') if m in sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out.strip().splitlines()[-1]) == []
