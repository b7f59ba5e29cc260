"""Model runner: owns the weights, the KV cache and (on CUDA, optionally) decode CUDA graphs.

Every forward and every weight mutation holds `lock`, so a weight update arriving from another thread
waits for the step in flight. `kv_epoch` is bumped whenever cached KV stops being valid (new weights,
released cache); the scheduler re-prefills any request whose KV was computed in an older epoch, so no
token is ever produced from KV computed under other weights, whatever the pause mode.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import torch

from miles.engines.embedded.kv_cache import KVCache
from miles.engines.embedded.model import CausalLM

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class PrefillResult:
    last_logits: torch.Tensor  # [N, V] fp32: logits at each sequence's last token
    all_logits: list[torch.Tensor | None]  # per sequence [T, V] fp32 where requested


class DecodeGraphs:
    """CUDA graphs of one decode step per batch-size bucket, attending over the whole cache length.

    Padded rows write to the scratch position, so they never touch a live cache entry. Graphs capture
    the addresses of the weights and the cache: weight updates copy in place (graphs stay valid);
    releasing memory drops the graphs and they are recaptured on the next decode.
    """

    def __init__(self, model: CausalLM, kv: KVCache, max_batch: int):
        self.model, self.kv = model, kv
        self.buckets = sorted({min(2**i, max_batch) for i in range(max_batch.bit_length() + 1)})
        device = model.device
        self.tokens = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None

    def _step(self, bucket: int) -> torch.Tensor:
        tok, pos = self.tokens[:bucket, None], self.positions[:bucket, None]
        hidden = self.model.forward(tok, pos, self.kv, 0, pos, kv_len=self.kv.k.shape[3])
        return self.model.logits(hidden[:, -1])

    def _capture(self, bucket: int) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm up kernels/allocator outside the graph
                self._step(bucket)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            self.outputs[bucket] = self._step(bucket)
        self.pool = graph.pool()
        self.graphs[bucket] = graph
        logger.info("captured decode CUDA graph for batch %d", bucket)

    def run(self, tokens: list[int], positions: list[int]) -> torch.Tensor:
        n = len(tokens)
        bucket = next(b for b in self.buckets if b >= n)
        self.tokens[:n].copy_(torch.tensor(tokens), non_blocking=True)
        self.positions[:n].copy_(torch.tensor(positions), non_blocking=True)
        self.tokens[n:bucket].zero_()
        self.positions[n:bucket].fill_(self.kv.scratch_pos)
        if bucket not in self.graphs:
            self._capture(bucket)
        self.graphs[bucket].replay()
        return self.outputs[bucket][:n]


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        *,
        max_running_requests: int,
        max_seq_len: int,
        use_cuda_graphs: bool,
    ):
        self.model = model
        self.lock = threading.RLock()
        self.kv_epoch = 0
        self.max_seq_len = max_seq_len
        self.max_running_requests = max_running_requests
        spec = model.spec
        self.kv = KVCache(
            num_layers=spec.num_layers,
            num_slots=max_running_requests,
            max_seq_len=max_seq_len,
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            dtype=model.dtype,
            device=model.device,
        )
        graphs_ok = model.device.type == "cuda" and not spec.moe_layers  # MoE routing syncs with the host
        if use_cuda_graphs and not graphs_ok:
            logger.warning(
                "CUDA graphs requested but unavailable here (device=%s, moe=%s); running eager",
                model.device,
                bool(spec.moe_layers),
            )
        self.use_cuda_graphs = use_cuda_graphs and graphs_ok
        self.graphs: DecodeGraphs | None = None
        self.weights_on_device = True

    @property
    def ready(self) -> bool:
        return self.kv.allocated and self.weights_on_device

    def invalidate_kv(self) -> None:
        with self.lock:
            self.kv_epoch += 1

    @torch.inference_mode()
    def prefill(self, seqs: list[list[int]], slot_start: int, want_all: list[bool]) -> PrefillResult:
        """Prefill sequences (from position 0) into slots [slot_start, slot_start + len(seqs))."""
        device = self.model.device
        lens = [len(s) for s in seqs]
        width = max(lens)
        tokens = torch.tensor([s + [0] * (width - len(s)) for s in seqs], device=device)
        positions = torch.arange(width, device=device)[None, :].expand(len(seqs), width)
        valid = positions < torch.tensor(lens, device=device)[:, None]
        write_pos = torch.where(valid, positions, torch.full_like(positions, self.kv.scratch_pos))
        with self.lock:
            hidden = self.model.forward(tokens, positions, self.kv, slot_start, write_pos, kv_len=None)
            last_idx = torch.tensor(lens, device=device) - 1
            last_hidden = hidden[torch.arange(len(seqs), device=device), last_idx]
            last_logits = self.model.logits(last_hidden)
            all_logits = [
                self.model.logits(hidden[i, :n]) if w else None
                for i, (n, w) in enumerate(zip(lens, want_all, strict=True))
            ]
        return PrefillResult(last_logits, all_logits)

    @torch.inference_mode()
    def decode(self, tokens: list[int], positions: list[int]) -> torch.Tensor:
        """One decode step for slots [0, len(tokens)); return logits [B, V] fp32."""
        with self.lock:
            if self.use_cuda_graphs:
                if self.graphs is None:
                    self.graphs = DecodeGraphs(self.model, self.kv, self.max_running_requests)
                return self.graphs.run(tokens, positions)
            device = self.model.device
            tok = torch.tensor(tokens, device=device)[:, None]
            pos = torch.tensor(positions, device=device)[:, None]
            hidden = self.model.forward(tok, pos, self.kv, 0, pos, kv_len=max(positions) + 1)
            return self.model.logits(hidden[:, -1])

    def move_slot(self, src: int, dst: int, length: int) -> None:
        if self.kv.allocated:
            self.kv.move_slot(src, dst, length)

    # ---- memory occupation (colocated offload) ---------------------------------------------------
    def release(self, tags: set[str]) -> None:
        with self.lock:
            if self.model.device.type != "cuda":
                logger.info("release_memory_occupation(%s) is a no-op on %s", sorted(tags), self.model.device)
                return
            self.graphs = None  # they hold addresses of what is about to move
            if "kv_cache" in tags and self.kv.allocated:
                self.kv.release()
                self.kv_epoch += 1
            if "weights" in tags and self.weights_on_device:
                self.model.move_to("cpu")
                self.weights_on_device = False
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    def resume(self, tags: set[str]) -> None:
        with self.lock:
            if self.model.device.type != "cuda":
                return
            if "weights" in tags and not self.weights_on_device:
                self.model.move_to(self.model.device)
                self.weights_on_device = True
            if "kv_cache" in tags:
                self.kv.allocate()
            torch.cuda.synchronize()
