"""Where a trainer's first seconds go on this machine: imports, the checkpoint, CUDA.

    python bench/import_cost.py                  # tiny Llama; --model smollm2: for the real checkpoint
    python bench/import_cost.py --runs 3         # fresh processes, one after another

Each run is a fresh Python process timing, in order: `import torch`; transformers' causal-LM auto class
and Llama's modeling module (what the FSDP backend imports); the first `from_pretrained` and a second one
(the difference is what the first call imports on the way); CUDA initialisation when there is a GPU.
A trainer pays all of these before its first step, so on a machine where they are slow, start-up is slow
whatever miles does. Ends with one JSON line: the per-run seconds and their medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

PROBE = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
torch.set_num_threads(1)
t1 = time.perf_counter()
from transformers import AutoModelForCausalLM
import transformers.models.llama.modeling_llama
t2 = time.perf_counter()
AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32, attn_implementation="sdpa")
t3 = time.perf_counter()
AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32, attn_implementation="sdpa")
t4 = time.perf_counter()
cuda = None
if torch.cuda.is_available():
    torch.empty(1, device="cuda")
    cuda = time.perf_counter() - t4
print(json.dumps({"import_torch": t1 - t0, "import_transformers_model": t2 - t1, "from_pretrained_first": t3 - t2,
                  "from_pretrained_again": t4 - t3, "cuda_init": cuda}))
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny:llama", help="model spec or directory")
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args(argv)
    from miles.models.resolve import resolve_spec

    model = resolve_spec(args.model)
    runs = []
    for _ in range(args.runs):
        out = subprocess.run([sys.executable, "-c", PROBE, model], capture_output=True, text=True, check=True)
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(json.dumps({k: None if v is None else round(v, 2) for k, v in runs[-1].items()}), flush=True)
    medians = {k: None if runs[0][k] is None else round(statistics.median(r[k] for r in runs), 2) for k in runs[0]}
    print(json.dumps({"model": model, "runs": args.runs, "median": medians}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
