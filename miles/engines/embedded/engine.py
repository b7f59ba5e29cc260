"""EmbeddedEngine: an in-process rollout engine with SGLang's request/response shapes.

Loads a HF causal LM (safetensors) and its tokenizer from a local directory and serves `generate`
through the continuous-batching scheduler. Weight updates copy into the live tensors by HF name;
`weight_version` is recorded for every generated token.

Prefix sharing (prefix_cache.py; on unless `prefix_cache=False`, the embedded form of SGLang's
`--disable-radix-cache`): full pages of K/V are shared by requests whose tokens start alike (a group's
samples, a session's turns), so a prefill computes only what the cache lacks; `cached_tokens` in the
response says how many prompt tokens came from it. `flush_cache` and every weight update drop all
pages. KV validity across weight updates is handled by the runner's KV epoch (see runner.py), which
covers every pause mode.

Memory (colocated offload, CUDA only; a no-op on CPU): releasing `weights` moves them to host memory,
releasing `kv_cache` frees the cache; running requests keep their tokens and are re-prefilled after
`resume_memory_occupation`. Weight loads are refused while weights are released.

Direct colocated updates (miles/weights/colocated_direct.py): the first `export_weight_buffer` packs
the weight storage into one flat buffer (shared memory on CPU) whose views the model then uses; a
trainer on the same device writes into it and calls `install_weight_buffer`. After a release the
buffer is gone; resume packs the host copy straight into a new one (a new generation).

Performance knobs: `cuda_graphs` (default: on for CUDA dense models) replays each decode step as one
CUDA graph per batch bucket; `fused_kernels` (default: on where triton runs on CUDA, for dense
models) runs decode steps, prefills and untruncated sampling with the Triton kernels of
triton_ops.py; decode steps shorter than `inline_step_s` (default: 3 ms on CPU, 0 elsewhere) run on
the event loop instead of a worker thread (the hand-off would cost as much as the step), as do all
decode steps while a lookahead is queued; `lookahead` (default: with CUDA graphs) launches the next
decode step before the host's bookkeeping of the current one (scheduler.py).

Rooms: engine_setup.py sizes and loads what the engine is built from, engine_weights.py changes its weights and
memory, request_intake.py checks prompts and seeds samples (determinism), responses.py answers in SGLang's shape.
"""

from __future__ import annotations

import asyncio
import logging
import uuid

import torch

from miles.engines.embedded import engine_setup, request_intake
from miles.engines.embedded.checkpoint import read_config
from miles.engines.embedded.engine_weights import EngineWeights
from miles.engines.embedded.logprob_extras import Extras, ExtrasRequest, check_request, extras_of, input_extras
from miles.engines.embedded.moe import check_routed_request, routed_buffer
from miles.engines.embedded.request import Request
from miles.engines.embedded.responses import generate_response, scoring_response
from miles.engines.embedded.runner import ModelRunner
from miles.engines.embedded.sampler import SamplingParams
from miles.engines.embedded.scheduler import Scheduler

logger = logging.getLogger(__name__)


class EmbeddedEngine(EngineWeights):
    def __init__(
        self,
        model_path: str,
        *,
        device: str = "cpu",
        dtype: str = "auto",
        max_running_requests: int = 64,
        max_total_tokens: int | None = None,
        seed: int = 0,
        deterministic: bool = False,
        max_prefill_tokens: int = 16384,
        cuda_graphs: bool | None = None,
        fused_kernels: bool | None = None,
        inline_step_s: float | None = None,
        lookahead: bool | None = None,
        true_on_policy: bool = False,
        prefix_cache: bool = True,
        prefix_cache_tokens: int | None = None,
        quantization: str | None = None,
        kv_cache_dtype: str = "auto",
    ):
        """prefix_cache_tokens: the shared pages' pool size in tokens (default: a quarter of the slots'
        capacity, max_running_requests x max_seq_len / 4). quantization "fp8" (SGLang's --quantization):
        serve a bf16 checkpoint in FP8, quantized per block at load; an FP8 checkpoint is served in FP8
        without it. kv_cache_dtype (SGLang's --kv-cache-dtype): "auto" stores the KV cache in the model's
        dtype, "fp8_e4m3" / "fp8_e5m2" in FP8 with scale 1 (kv_cache.py): a byte a value, half of bf16's, so
        a given max_total_tokens takes half the memory and a decode step reads half the KV bytes."""
        from miles.utils.timer import PhaseClock
        from miles.utils.tokenizer_file import load_engine_tokenizer

        clock = PhaseClock()

        self.model_path = model_path
        self.device = torch.device(device)
        config = read_config(model_path)
        self.dtype = engine_setup.resolve_dtype(dtype, config, self.device)
        self.kv_dtype = engine_setup.resolve_kv_dtype(kv_cache_dtype, self.dtype, true_on_policy)
        self.tokenizer = load_engine_tokenizer(model_path)  # no transformers import where the file suffices
        clock.mark("tokenizer")
        self.model, self.fp8 = engine_setup.load_model(
            model_path, config, self.device, self.dtype, quantization, true_on_policy
        )
        clock.mark("weights")
        spec = self.model.spec
        self.max_seq_len = engine_setup.slot_len(
            spec, self.kv_dtype, self.device, max_running_requests, max_total_tokens
        )
        # No token spans more characters than the longest vocabulary entry, so a longer text cannot fit
        # the context and is refused before tokenising (x2: normalizers may fold characters).
        self.max_prompt_chars = 2 * self.max_seq_len * max((len(t) for t in self.tokenizer.get_vocab()), default=1)
        prefix_pages = engine_setup.prefix_pages(
            prefix_cache, prefix_cache_tokens, max_running_requests, self.max_seq_len
        )
        self.runner = self._build_runner(max_running_requests, cuda_graphs, fused_kernels, prefix_pages)
        clock.mark("runner")
        self.seed = seed
        self.deterministic = deterministic
        self.eos_ids = engine_setup.eos_ids(config, self.tokenizer)
        self._weight_version = 0
        self.init_weight_state()
        self._init_scheduling(max_prefill_tokens, inline_step_s, lookahead)
        # --true-on-policy-mode: prefill-only scoring goes through the trainer's reference forward
        self.reference = self._reference_model() if true_on_policy else None
        logger.info("engine built in %s", clock.summary())

    def _reference_model(self):
        from miles.engines.embedded.reference import ReferenceModel

        return ReferenceModel(self.model_path, self.model)

    def _build_runner(
        self, max_running_requests: int, cuda_graphs: bool | None, fused_kernels: bool | None, prefix_pages: int
    ) -> ModelRunner:
        # cuda_graphs None = on where they work (CUDA, dense models): about 3x faster decode than eager
        graphs = (
            cuda_graphs if cuda_graphs is not None else engine_setup.graphs_supported(self.device, self.model.spec)
        )
        return ModelRunner(
            self.model,
            max_running_requests=max_running_requests,
            max_seq_len=self.max_seq_len,
            use_cuda_graphs=graphs,
            fused_kernels=fused_kernels,
            prefix_cache_pages=prefix_pages,
            kv_dtype=self.kv_dtype,
        )

    def _init_scheduling(self, max_prefill_tokens: int, inline_step_s: float | None, lookahead: bool | None) -> None:
        """What `start` hands the scheduler; no scheduler runs before it."""
        self._children: dict[str, list[str]] = {}
        self._batch_generator = torch.Generator(device=self.device).manual_seed(self.seed)
        self.scheduler: Scheduler | None = None
        self._task: asyncio.Task | None = None
        self._max_prefill_tokens = max_prefill_tokens
        # None = with CUDA graphs, where the GPU runs ahead of the host (see scheduler.py)
        self._lookahead = self.runner.use_cuda_graphs if lookahead is None else lookahead
        # CPU decode steps of tiny models are shorter than a thread hand-off: run those on the loop
        self._inline_step_s = (
            inline_step_s if inline_step_s is not None else (0.003 if self.device.type == "cpu" else 0.0)
        )

    def prefix_cache_stats(self) -> dict:
        """Prefill tokens requested and computed since the start, and the pool's pages (cached, referenced,
        evicted since the start)."""
        sched, cache = self.scheduler, self.runner.prefix_cache
        requested = sched.sharing.prefill_tokens_requested if sched else 0
        computed = sched.sharing.prefill_tokens_computed if sched else 0
        return {
            "enabled": cache is not None,
            "prefill_tokens_requested": requested,
            "prefill_tokens_computed": computed,
            "prefix_hit_rate": (requested - computed) / requested if requested else 0.0,
            "cached_pages": cache.cached_pages if cache else 0,
            "referenced_pages": cache.referenced_pages if cache else 0,
            "evicted_pages": cache.evicted if cache else 0,
        }

    # ---- lifecycle ---------------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._task is not None:
            raise RuntimeError("EmbeddedEngine.start() called twice")
        self.scheduler = Scheduler(
            self.runner,
            check_stop_strings=lambda req: request_intake.check_stop_strings(self.tokenizer, req),
            weight_version=lambda: self.weight_version,
            max_prefill_tokens=self._max_prefill_tokens,
            batch_generator=self._batch_generator,
            inline_step_s=self._inline_step_s,
            lookahead=self._lookahead,
        )
        self._task = asyncio.create_task(self.scheduler.run(), name="embedded-engine-scheduler")

    async def shutdown(self) -> None:
        if self._task is not None:
            self.scheduler.abort(None)
            self.scheduler.stop()
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            except Exception:  # already logged by the scheduler; its requests were failed
                pass
            self.scheduler.abort_pending()  # a step cancelled mid-flight must not leave callers waiting
            self._task = None
        self.runner.close()  # the graphs' memory pool goes now, not when the last reference to the engine does
        self._shared.close()  # unlinks the CPU segment; the model's views keep their mapping

    def _require_started(self) -> Scheduler:
        if self.scheduler is None or self._task is None:
            raise RuntimeError("EmbeddedEngine is not started; await engine.start() inside the event loop first")
        if self._task.done() and not self._task.cancelled() and self._task.exception():
            raise RuntimeError(f"engine scheduler died: {self._task.exception()!r}")
        return self.scheduler

    # ---- generate ----------------------------------------------------------------------------------------
    async def generate(
        self,
        *,
        input_ids: list[int] | None = None,
        text: str | None = None,
        sampling_params: dict | None = None,
        rid: str | None = None,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int | None = None,
        token_ids_logprob: list[int] | None = None,
        return_routed_experts: bool = False,
        routed_experts_start_len: int = 0,
    ) -> dict | list[dict]:
        """One SGLang /generate prompt. `top_logprobs_num` / `token_ids_logprob` (with `return_logprob`) add each
        position's top-k tokens / the listed ids' log-probs, for the output and for the input from
        `logprob_start_len` on. `return_routed_experts` (MoE models) adds `meta_info["routed_experts"]`, SGLang's
        base64 int32 [seq_len - 1 - routed_experts_start_len, moe_layers, k] (miles/utils/routing.py)."""
        scheduler = self._require_started()
        params = SamplingParams.from_dict(sampling_params)
        prompt = await request_intake.prompt_ids(
            input_ids,
            text,
            params,
            tokenizer=self.tokenizer,
            vocab_size=self.model.spec.vocab_size,
            max_seq_len=self.max_seq_len,
            max_prompt_chars=self.max_prompt_chars,
        )
        if logprob_start_len >= len(prompt):
            raise ValueError(f"logprob_start_len={logprob_start_len} must be < prompt length {len(prompt)}")
        extras = check_request(top_logprobs_num, token_ids_logprob, self.model.spec.vocab_size)
        if not return_logprob:
            extras = ExtrasRequest()  # SGLang computes them only alongside the log-probs
        routed_capacity = len(prompt) + params.max_new_tokens if return_routed_experts else 0
        if return_routed_experts:
            check_routed_request(self.model.spec, routed_experts_start_len, len(prompt))
        rid = rid or uuid.uuid4().hex
        scoring = return_logprob and logprob_start_len >= 0 and params.max_new_tokens == 0 and params.n == 1
        if scoring and self.reference is not None and not return_routed_experts:
            return await self._reference_score(scheduler, rid, prompt, params, logprob_start_len, extras)
        rids = request_intake.sample_rids(rid, params.n, self.runner.max_running_requests)
        if params.n > 1:
            self._children[rid] = rids  # an abort of `rid` reaches every sample
        reqs = [
            self._request(
                r,
                i,
                prompt,
                params,
                extras,
                return_logprob=return_logprob,
                logprob_start_len=logprob_start_len,
                routed_capacity=routed_capacity,
                routed_start=routed_experts_start_len,
            )
            for i, r in enumerate(rids)
        ]
        for req in reqs:
            scheduler.submit(req)
        try:
            done = await asyncio.gather(*(req.future for req in reqs))
        finally:
            self._children.pop(rid, None)
        outs = [generate_response(req, self.tokenizer, self.weight_version) for req in done]
        return outs[0] if params.n == 1 else outs

    def _request(
        self,
        rid: str,
        index: int,
        prompt: list[int],
        params: SamplingParams,
        extras: ExtrasRequest,
        *,
        return_logprob: bool,
        logprob_start_len: int,
        routed_capacity: int,
        routed_start: int,
    ) -> Request:
        """Sample `index` of a prompt as the scheduler runs it: its generator, stop ids and routing buffer."""
        return Request(
            rid=rid,
            prompt_ids=prompt,
            params=params,
            return_logprob=return_logprob,
            logprob_start_len=logprob_start_len,
            future=asyncio.get_running_loop().create_future(),
            generator=request_intake.request_generator(
                params, rid, index, engine_seed=self.seed, deterministic=self.deterministic, device=self.device
            ),
            stop_ids=frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_ids),
            extras=extras,
            routed=routed_buffer(self.model.spec, routed_capacity),
            routed_start=routed_start,
        )

    # ---- true-on-policy scoring ---------------------------------------------------------------------------
    async def _reference_score(
        self,
        scheduler: Scheduler,
        rid: str,
        prompt: list[int],
        params: SamplingParams,
        start: int,
        extras: ExtrasRequest,
    ) -> dict:
        """A prefill-only scoring request through the reference forward (true-on-policy mode): held back while
        generation is paused (a weight update may be under way), then run under the runner's lock."""
        await scheduler.wait_unpaused()
        lps, extra, version = await self.runner.in_worker(
            self._reference_locked, prompt, start, params.temperature, extras
        )
        return scoring_response(rid, prompt, start, lps, extras, extra, version)

    def _reference_locked(
        self, prompt: list[int], start: int, temperature: float, extras: ExtrasRequest
    ) -> tuple[list[float | None], Extras, int]:
        with self.runner.lock:
            if not self.runner.weights_on_device:
                raise RuntimeError("weights are released; call resume_memory_occupation(['weights']) first")
            self.reference.sync(self.runner.kv_epoch)
            first = max(start, 1)  # position 0 predicts nothing (SGLang reports None there)
            if first < len(prompt):
                rows = self.reference.log_probs(prompt, first, temperature)
            else:
                rows = torch.empty((0, self.model.spec.vocab_size), device=self.device)
            targets = torch.tensor(prompt[first:], dtype=torch.long, device=rows.device)
            lps = rows.gather(-1, targets[:, None]).squeeze(-1).tolist()
            extra = input_extras(extras_of(rows, extras), start) if extras.wanted else Extras()
            return ([None] if start == 0 else []) + lps, extra, self.weight_version

    # ---- control -------------------------------------------------------------------------------------------
    def abort(self, rid: str | None = None, abort_all: bool = False) -> None:
        scheduler = self._require_started()
        if abort_all:
            scheduler.abort(None)
        elif rid is not None:
            scheduler.abort(set(self._children.get(rid, [rid])))
        else:
            raise ValueError("abort needs rid=... or abort_all=True")

    async def pause_generation(self, mode: str = "retract") -> None:
        await self._require_started().pause(mode)

    async def continue_generation(self) -> None:
        self._require_started().resume()

    def flush_cache(self) -> bool:
        """Drop every shared prefix page (running requests keep their slots); stale KV is handled by epochs."""
        if self.runner.prefix_cache is not None:
            with self.runner.lock:
                self.runner.prefix_cache.clear()
        return True

    @property
    def num_active_requests(self) -> int:
        return self.scheduler.num_active if self.scheduler else 0

    # ---- weights -------------------------------------------------------------------------------------------
    @property
    def weight_version(self) -> int:
        return self._weight_version

    @weight_version.setter
    def weight_version(self, value: int) -> None:
        """Every weight update ends here: the log says how the requests served under the old weights were
        batched (many prefill steps for one rollout mean its requests arrived spread out)."""
        self._weight_version = int(value)
        if self.scheduler is not None:
            logger.info(
                "weight_version %d; served before it: %s", self._weight_version, self.scheduler.take_counts().summary()
            )

    def model_info(self) -> dict:
        s = self.model.spec
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.model_path,
            "is_generation": True,
            "weight_version": str(self.weight_version),
            "model_type": s.model_type,
            "device": str(self.device),
            "dtype": str(self.dtype).replace("torch.", ""),
            "max_running_requests": self.runner.max_running_requests,
            "max_seq_len": self.max_seq_len,
            "deterministic": self.deterministic,
            "quantization": "fp8" if self.fp8 else None,
        }
