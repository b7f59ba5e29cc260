"""Model runner: owns the weights, the KV cache and (on CUDA, optionally) decode CUDA graphs.

Every forward and every weight mutation holds `lock`, so a weight update arriving from another thread
waits for the step in flight. `kv_epoch` is bumped whenever cached KV stops being valid (new weights,
released cache); the scheduler re-prefills any request whose KV was computed in an older epoch, so no
token is ever produced from KV computed under other weights, whatever the pause mode.

All of the engine's device work off the event loop runs on one thread (`in_worker`), and graph warm-ups
on one side stream: cuBLAS keeps a workspace (32 MiB on Hopper) for every thread handle and stream pair it
has seen and frees none, so a pool of threads and a new stream per capture made the engine's allocated
memory grow by 0.1-0.2 GiB a release cycle. A release also gives the workspaces back
(`give_back_cached_memory`).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import torch

from miles.engines.embedded import fused_forward, triton_ops
from miles.engines.embedded.kv_cache import KVCache
from miles.engines.embedded.model import CausalLM
from miles.engines.embedded.moe import Routing
from miles.engines.embedded.prefix_cache import DEFAULT_PAGE_SIZE, PrefixCache
from miles.engines.embedded.transfer import to_device
from miles.engines.embedded.triton_ops import DecodeAttention
from miles.utils.cuda_cache import give_back_cached_memory

logger = logging.getLogger(__name__)

T = TypeVar("T")


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

    def __init__(
        self,
        model: CausalLM,
        kv: KVCache,
        max_batch: int,
        attention: DecodeAttention | None,
        warmup_stream: torch.cuda.Stream,
    ):
        self.model, self.kv, self.attention, self.warmup_stream = model, kv, attention, warmup_stream
        self.buckets = sorted({min(2**i, max_batch) for i in range(max_batch.bit_length() + 1)})
        device = model.device
        self.inputs = torch.zeros((3, max_batch), dtype=torch.long, device=device)
        self.tokens, self.positions, self.lens = self.inputs  # rows: static graph inputs
        self.lens.fill_(1)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None

    def _step(self, bucket: int) -> torch.Tensor:
        if self.attention is not None:
            tok, pos, lens = self.tokens[:bucket], self.positions[:bucket], self.lens[:bucket]
            hidden = fused_forward.decode_fused(self.model, tok, pos, lens, self.kv, self.attention)
            return self.model.logits(hidden, fp32=False)
        tok, pos = self.tokens[:bucket, None], self.positions[:bucket, None]
        hidden = self.model.forward(tok, pos, self.kv, 0, pos, kv_len=self.kv.k.shape[3])
        return self.model.logits(hidden[:, -1])

    def _capture(self, bucket: int) -> None:
        stream = self.warmup_stream
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

    def run(self, tokens: list[int] | torch.Tensor, positions: list[int]) -> torch.Tensor:
        """Replay the step for len(positions) rows; tokens from the host or already on the device."""
        n = len(positions)
        bucket = next(b for b in self.buckets if b >= n)
        # tokens | positions | lens staged in pinned memory: the copies never wait for the GPU
        staged = torch.empty((3, bucket), dtype=torch.long, pin_memory=True)
        staged[1, :n] = torch.tensor(positions)
        staged[2, :n] = staged[1, :n] + 1
        staged[0, n:] = 0  # padded rows: token 0 at the scratch position, attending to one key
        staged[1, n:] = self.kv.scratch_pos
        staged[2, n:] = 1
        on_device = isinstance(tokens, torch.Tensor)
        if not on_device:
            staged[0, :n] = torch.tensor(tokens)
        self.inputs[:, :bucket].copy_(staged, non_blocking=True)
        if on_device:
            self.tokens[:n].copy_(tokens)
        if bucket not in self.graphs:
            self._capture(bucket)
        self.graphs[bucket].replay()
        return self.outputs[bucket][:n]

    def close(self) -> None:
        """Give the graphs' memory pool back now, not when the last reference to this object goes."""
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.outputs.clear()
        self.pool = None


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        *,
        max_running_requests: int,
        max_seq_len: int,
        use_cuda_graphs: bool,
        fused_kernels: bool | None = None,
        prefix_cache_pages: int = 0,
        prefix_page_size: int = DEFAULT_PAGE_SIZE,
        kv_dtype: torch.dtype | None = None,
    ):
        """kv_dtype: what the KV cache stores (default: the model's dtype; FP8, see kv_cache.py)."""
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
            storage_dtype=kv_dtype,
        )
        # prefix sharing (prefix_cache.py); 0 pages: off
        self.prefix_cache = _prefix_cache(model, prefix_cache_pages, prefix_page_size, self.kv.storage_dtype)
        self.use_cuda_graphs = _cuda_graphs(model, use_cuda_graphs)
        # None = on where they work (CUDA + triton, dense): nine kernels a decode layer instead of ~27
        self.fused_kernels = _fused_kernels(model, fused_kernels, self.kv.storage_dtype)
        self.attention = None
        if self.fused_kernels:
            cuda = model.device.type == "cuda"
            sms = torch.cuda.get_device_properties(model.device).multi_processor_count if cuda else 8
            self.attention = triton_ops.DecodeAttention(
                spec.num_heads, spec.num_kv_heads, spec.head_dim, self.kv.capacity, sms,
                **triton_ops.attention_settings(self.kv.storage_dtype),
            )  # fmt: skip
        self.graphs: DecodeGraphs | None = None
        # graph captures warm up on this one stream (see the module doc)
        self._warmup_stream = torch.cuda.Stream(model.device) if self.use_cuda_graphs else None
        self._worker: ThreadPoolExecutor | None = None  # the device thread (in_worker), made on first use
        self.weights_on_device = True
        self._logged_residual: int | None = None  # bytes still reserved after the last logged release

    async def in_worker(self, fn: Callable[..., T], *args) -> T:
        """fn(*args) on the engine's device thread (one for the engine's life; see the module doc)."""
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-device")
        call = functools.partial(contextvars.copy_context().run, fn, *args)
        return await asyncio.get_running_loop().run_in_executor(self._worker, call)

    def close(self) -> None:
        """The engine is shutting down: its graphs' memory goes now, and its device thread ends."""
        self.drop_graphs()
        if self._worker is not None:
            self._worker.shutdown(wait=False)
            self._worker = None

    @property
    def ready(self) -> bool:
        return self.kv.allocated and self.weights_on_device

    def invalidate_kv(self) -> None:
        """Cached KV is stale from now on (new weights): slots are re-prefilled, shared pages dropped."""
        with self.lock:
            self.kv_epoch += 1
            if self.prefix_cache is not None:
                self.prefix_cache.clear()

    @torch.inference_mode()
    def prefill(
        self,
        seqs: list[list[int]],
        slot_start: int,
        want_all: list[bool],
        starts: list[int] | None = None,
        routing: Routing | None = None,
    ) -> PrefillResult:
        """Prefill sequences into slots [slot_start, slot_start + len(seqs)). starts[i] > 0: the slot already
        holds the K/V of that many leading tokens (a prefix cache hit) and seqs[i] are the tokens after them.
        `routing` collects every MoE layer's experts of all [B x width] tokens (padding included, see
        forward); it needs every sequence computed from position 0. Sequences from position 0 that come before
        the first hit run as an ordinary prefill, the rest as an extend (the scheduler puts hits last): a hit's
        few new tokens are not padded to a miss's whole prompt."""
        if starts is not None and any(starts):
            if routing is not None:
                raise ValueError("prefill: routing is recorded over whole sequences; reuse no cached prefix")
            m = next(j for j, start in enumerate(starts) if start)
            if any(want_all[m:]):
                raise ValueError("prefill: input log-probs need every position computed; order such requests first")
            if m == 0:
                return self._prefill_extend(seqs, slot_start, starts)
            head = self.prefill(seqs[:m], slot_start, want_all[:m])
            tail = self._prefill_extend(seqs[m:], slot_start + m, starts[m:])
            return PrefillResult(torch.cat([head.last_logits, tail.last_logits]), head.all_logits + tail.all_logits)
        device = self.model.device
        lens = [len(s) for s in seqs]
        width = max(lens)
        tokens = to_device([s + [0] * (width - len(s)) for s in seqs], device)
        lens_dev = to_device(lens, device)
        positions = torch.arange(width, device=device)[None, :].expand(len(seqs), width)
        valid = positions < lens_dev[:, None]
        write_pos = torch.where(valid, positions, torch.full_like(positions, self.kv.scratch_pos))
        last_idx = lens_dev - 1
        with self.lock:
            if not any(want_all) and routing is None:  # only the last tokens' hidden states are needed
                last_hidden = self._last_hidden(tokens, positions, write_pos, last_idx, slot_start)
                return PrefillResult(self.model.logits(last_hidden), [None] * len(seqs))
            hidden = self.model.forward(
                tokens, positions, self.kv, slot_start, write_pos, kv_len=None, routing=routing
            )
            last_hidden = hidden[torch.arange(len(seqs), device=device), last_idx]
            last_logits = self.model.logits(last_hidden)
            all_logits = [
                self.model.logits(hidden[i, :n]) if w else None
                for i, (n, w) in enumerate(zip(lens, want_all, strict=True))
            ]
        return PrefillResult(last_logits, all_logits)

    def _prefill_extend(self, seqs: list[list[int]], slot_start: int, starts: list[int]) -> PrefillResult:
        """Prefill the tokens after cached prefixes: each attends over its slot's cache (prefix + itself), with
        the Triton kernels where they run; returns last logits."""
        device = self.model.device
        lens = [len(s) for s in seqs]
        width = max(lens)
        tokens = to_device([s + [0] * (width - len(s)) for s in seqs], device)
        lens_dev, starts_dev = to_device([lens, starts], device)
        offsets = torch.arange(width, device=device)[None, :]
        valid = offsets < lens_dev[:, None]
        # padded tokens sit at position 0 (they attend to one key) and write to the scratch position
        positions = torch.where(valid, offsets + starts_dev[:, None], 0)
        write_pos = torch.where(valid, positions, torch.full_like(positions, self.kv.scratch_pos))
        last_idx = lens_dev - 1
        kv_len = max(s + n for s, n in zip(starts, lens, strict=True))
        with self.lock:
            last_hidden = self._last_hidden(tokens, positions, write_pos, last_idx, slot_start, extend_len=kv_len)
            return PrefillResult(self.model.logits(last_hidden), [None] * len(seqs))

    def _last_hidden(self, tokens, positions, write_pos, last_idx, slot_start, extend_len=None) -> torch.Tensor:
        """A prefill's (or, with extend_len, an extend's) final-normed hidden at each row's last_idx: through the
        Triton kernels where they run, else the eager forward."""
        if self.attention is not None:
            return fused_forward.prefill_fused(
                self.model, tokens, positions, write_pos, last_idx, self.kv, slot_start, self.attention,
                extend_len=extend_len,
            )  # fmt: skip
        return self.model.forward(
            tokens, positions, self.kv, slot_start, write_pos, kv_len=None, out_index=last_idx, extend_len=extend_len
        )

    @torch.inference_mode()
    def decode(
        self, tokens: list[int] | torch.Tensor, positions: list[int], routing: Routing | None = None
    ) -> torch.Tensor:
        """One decode step for slots [0, len(tokens)); return logits [B, V] (fp32; the model dtype with
        fused kernels, whose sampler converts on load). `routing` collects the MoE layers' experts (eager)."""
        with self.lock:
            if routing is not None:
                device = self.model.device
                tok, pos = to_device(tokens, device)[:, None], to_device(positions, device)[:, None]
                hidden = self.model.forward(tok, pos, self.kv, 0, pos, kv_len=max(positions) + 1, routing=routing)
                return self.model.logits(hidden[:, -1])
            if self.use_cuda_graphs:
                if self.graphs is None:
                    self.graphs = DecodeGraphs(
                        self.model, self.kv, self.max_running_requests, self.attention, self._warmup_stream
                    )
                return self.graphs.run(tokens, positions)
            device = self.model.device
            if self.attention is not None:
                tok, pos = to_device(tokens, device), to_device(positions, device)
                hidden = fused_forward.decode_fused(self.model, tok, pos, pos + 1, self.kv, self.attention)
                return self.model.logits(hidden, fp32=False)
            tok, pos = to_device(tokens, device)[:, None], to_device(positions, device)[:, None]
            hidden = self.model.forward(tok, pos, self.kv, 0, pos, kv_len=max(positions) + 1)
            return self.model.logits(hidden[:, -1])

    def drop_graphs(self) -> None:
        """Forget the captured decode graphs (recaptured at the next decode) and free their memory."""
        with self.lock:  # not while a decode step replays one of them
            if self.graphs is not None:
                self.graphs.close()
                self.graphs = None

    def move_slot(self, src: int, dst: int, length: int) -> None:
        if self.kv.allocated:
            self.kv.move_slot(src, dst, length)

    # ---- memory occupation (colocated offload) ---------------------------------------------------
    def release(self, tags: set[str]) -> None:
        with self.lock:
            if self.model.device.type != "cuda":
                logger.info("release_memory_occupation(%s) is a no-op on %s", sorted(tags), self.model.device)
                return
            self.drop_graphs()  # they hold addresses of what is about to move
            if "kv_cache" in tags and self.kv.allocated:
                self.kv.release()
                self.kv_epoch += 1
                if self.prefix_cache is not None:
                    self.prefix_cache.release()
            if "weights" in tags and self.weights_on_device:
                self.model.move_to("cpu")
                self.weights_on_device = False
            give_back_cached_memory()
            self._log_residual(tags)

    def _log_residual(self, tags: set[str]) -> None:
        """What the engine still holds after a release is what a colocated trainer cannot have: logged at the
        first release and whenever it moves by a GiB, so that a trainer's out-of-memory can be traced here."""
        reserved = torch.cuda.memory_reserved(self.model.device)
        if self._logged_residual is not None and abs(reserved - self._logged_residual) < 2**30:
            return
        self._logged_residual = reserved
        logger.info(
            "released %s: %.2f GiB allocated, %.2f GiB reserved by this engine remain on %s",
            ",".join(sorted(tags)),
            torch.cuda.memory_allocated(self.model.device) / 2**30,
            reserved / 2**30,
            self.model.device,
        )

    def resume(self, tags: set[str]) -> None:
        with self.lock:
            if self.model.device.type != "cuda":
                return
            if "weights" in tags and not self.weights_on_device:
                self.model.move_to(self.model.device)
                self.weights_on_device = True
            if "kv_cache" in tags:
                self.kv.allocate()
                if self.prefix_cache is not None:
                    self.prefix_cache.allocate()
            torch.cuda.synchronize()


def _prefix_cache(model: CausalLM, pages: int, page_size: int, kv_dtype: torch.dtype) -> PrefixCache | None:
    """The pool of shared prefix pages (prefix_cache.py) in the KV cache's storage dtype, None when `pages` is 0
    (prefix sharing off)."""
    if pages <= 0:
        return None
    spec = model.spec
    return PrefixCache(
        page_size=page_size,
        num_pages=pages,
        num_layers=spec.num_layers,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        dtype=kv_dtype,
        device=model.device,
    )


def _cuda_graphs(model: CausalLM, requested: bool) -> bool:
    """Decode CUDA graphs on: where requested and they can run for this model here (else logged, and eager)."""
    spec = model.spec
    # MoE: the grouped experts are capturable (tests/gpu/test_moe_gpu.py); whole-step graphs stay off for MoE
    # until that capture is verified on the GPU host
    graphs_ok = model.device.type == "cuda" and not spec.moe_layers
    if requested and not graphs_ok:
        logger.warning(
            "CUDA graphs requested but unavailable here (device=%s, moe=%s); running eager",
            model.device,
            bool(spec.moe_layers),
        )
    return requested and graphs_ok


def _fused_kernels(model: CausalLM, requested: bool | None, kv_dtype: torch.dtype) -> bool:
    """The Triton kernels on (None: where they work); True where they cannot run is refused (ValueError)."""
    spec = model.spec
    fused_ok = triton_ops.available(model.device) and triton_ops.supports(spec)
    if requested and not fused_ok:
        raise ValueError(
            f"fused_kernels=True needs triton on CUDA and a dense model with a power-of-two head_dim "
            f"(device={model.device}, head_dim={spec.head_dim}, moe={bool(spec.moe_layers)}); "
            "leave it unset to use them where they work"
        )
    e4m3_ok = kv_dtype != torch.float8_e4m3fn or triton_ops.converts_e4m3(model.device)
    if not e4m3_ok and requested is not False:
        why = (
            f"an fp8_e4m3 KV cache on {model.device} (compute capability "
            f"{torch.cuda.get_device_capability(model.device)}): Triton converts e4m3 from 8.9 on"
        )
        if requested:
            raise ValueError(
                f"fused_kernels=True with {why}; use kv_cache_dtype fp8_e5m2, or leave fused_kernels unset"
            )
        logger.warning("fused kernels off with %s; the eager forward serves it", why)
    return (fused_ok and e4m3_ok) if requested is None else requested
