"""megatron-core for the fork server's rank processes, when MILES_MCORE_SITE names its unpacked wheel.

tests/conftest.py lists this module in the fork server's preload when MILES_MCORE_SITE is set: the
megatron CPU tests (test_mcore_model_cpu.py, test_mcore_moe_cpu.py) start a rank group per check, and
each rank spent seconds importing megatron-core before its first line of work. The fork server (Python
3.11 starts it without the test process's `sys.path`) puts the site on its own path and imports the
modules once; each rank still gets the test process's `sys.path` at its start. Imports only: no thread,
no device. A failure here leaves the ranks to import (and fail or skip) on their own.
"""

from __future__ import annotations

import os
import sys
import warnings

_SITE = os.environ.get("MILES_MCORE_SITE")
if _SITE:
    sys.path.insert(0, _SITE)
    try:
        with warnings.catch_warnings():  # no Apex / Transformer Engine here: the tests' own import says so
            warnings.simplefilter("ignore")
            import megatron.core.distributed  # noqa: F401
            import megatron.core.transformer.moe.token_dispatcher  # noqa: F401

            import miles.trainer.mcore_model  # noqa: F401
            import miles.trainer.megatron  # noqa: F401
            import miles.trainer.megatron_weights  # noqa: F401
    except Exception:  # noqa: BLE001, S110  (the tests' own import reports it)
        pass
