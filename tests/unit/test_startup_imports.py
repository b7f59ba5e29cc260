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


def test_an_engine_serves_without_importing_transformers():
    code = (
        "import sys, asyncio\n"
        "from miles.models.resolve import resolve_spec\n"
        "from miles.engines.embedded.engine import EmbeddedEngine\n"
        "from miles.engines.http_front import start_http_server\n"
        "from miles.weights.receiver import WeightReceiver\n"
        "async def main():\n"
        "    engine = EmbeddedEngine(resolve_spec('tiny:'), max_running_requests=2, max_total_tokens=256)\n"
        "    await engine.start()\n"
        "    http = await start_http_server(engine, '127.0.0.1', 0, receiver=WeightReceiver(engine))\n"
        "    out = await engine.generate(input_ids=[1, 2, 3], sampling_params={'max_new_tokens': 2})\n"
        "    assert out['output_ids'] if isinstance(out, dict) else out\n"
        "    await http.stop()\n"
        "    await engine.shutdown()\n"
        "asyncio.run(main())\n"
        "print('transformers' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"
