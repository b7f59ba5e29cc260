"""True-on-policy mode (`--true-on-policy-mode`): the rollout engine and the trainer score every sampled
token with bit-identical log-probs.

Both sides run one reference forward, `scoring.py`: the model's own `transformers` implementation
with eager attention, one sequence per call (batch 1, the same length and the same positions on both
sides, so no reduction depends on how many sequences share a batch), the same logits slice, the same
fp32 log-softmax, under the same deterministic settings (`deterministic_scoring`). The engine keeps
generating with its fast kernels and re-scores each finished sequence with that forward over its own
weights (`miles/engines/embedded/reference.py`); the FSDP trainer computes its old and new log-probs
with it. `coverage.py` refuses, at start-up, what the mode cannot make exact.
"""

ATTN_IMPLEMENTATION = "eager"  # plain matmul + softmax: the same kernels in scoring-only and training passes
CPU_THREADS = 1  # intra-op threads of a reference forward on CPU: no GEMM splits its reduction by thread count
CUBLAS_WORKSPACE_CONFIG = ":4096:8"  # what cuBLAS needs for deterministic GEMMs (set before CUDA starts)
