"""Short full garbage collections in long-lived processes.

A full (oldest-generation) collection walks every object the interpreter tracks. A process that has
imported torch and transformers and built a model tracks some 400K of them, and on the dev machine's
CPU such a collection stopped it for 150-180 ms: one round of `bench/engine_throughput.py` in five ran
at about 0.6x the others' rate. The objects alive once a worker is ready (modules, the model's wrappers,
the tokenizer, compiled graphs) live as long as the process. `freeze_heap` collects once and moves them
into the permanent generation, which later collections skip; what is made afterwards (requests,
samples, batches) is collected as before.
"""

from __future__ import annotations

import gc
import logging
import time

logger = logging.getLogger(__name__)


def freeze_heap(where: str) -> None:
    """Collect garbage once, then keep every object alive now out of later collections (logged)."""
    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    logger.info(
        "%s: %d objects kept out of garbage collection (%.2f s)",
        where,
        gc.get_freeze_count(),
        time.perf_counter() - start,
    )
