"""A worker on its way out ends multiprocessing's resource tracker by closing its pipe, not by signals.

The tracker ignores SIGTERM: signalled, it would be waited for through the whole grace period and then
SIGKILLed, which also skips its own clean-up of what is still registered (the property checked here).
"""

from __future__ import annotations

import json
import subprocess
import sys

from harness import train_env

# In a child process: the tests' own process may hold a tracker other tests share.
CHILD = """
import json, os
from multiprocessing import shared_memory
from miles.wire.procs import kill_own_descendants

shm = shared_memory.SharedMemory(create=True, size=4096)  # starts the tracker and registers the segment
shm.close()  # left registered and not unlinked, as a worker that died mid-transfer would leave it
path = "/dev/shm/" + shm.name.lstrip("/")
kill_own_descendants(grace_s=60.0)
left = os.path.exists(path)
if left:
    os.unlink(path)
print(json.dumps({"left": left}))
"""


def test_the_resource_tracker_exits_by_itself_and_unlinks_what_was_left() -> None:
    proc = subprocess.run([sys.executable, "-c", CHILD], env=train_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the tracker unlinks what is still registered when its pipe closes; a SIGKILL (where the grace period
    # ends when it is sent SIGTERM) leaves the segment behind
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"left": False}
