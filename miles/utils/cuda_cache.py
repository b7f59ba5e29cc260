"""Give back what a process holds on its GPU that no tensor uses, for another process on the same GPU."""

from __future__ import annotations

import torch


def give_back_cached_memory() -> None:
    """The caching allocator's free blocks and cuBLAS's workspaces go back to the driver. cuBLAS keeps a
    workspace (32 MiB on Hopper) for every thread handle and stream pair it has seen and frees none by itself;
    the next GEMM allocates one again. Blocks this process shared over CUDA IPC and has freed wait in torch's
    "limbo" while another process's reference count on them is positive: those whose count has fallen are
    freed here too. Waits for the device first: no kernel may still be using a workspace."""
    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()  # noqa: SLF001 - torch's only door to them
    torch.cuda.ipc_collect()
    torch.cuda.empty_cache()
