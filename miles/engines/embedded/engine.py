"""EmbeddedEngine: an in-process rollout engine with SGLang's request/response shapes.

Loads a HF causal LM (safetensors) and its tokenizer from a local directory and serves `generate`
through the continuous-batching scheduler. Weight updates copy into the live tensors by HF name;
`weight_version` is recorded for every generated token.

Determinism: with `deterministic=True` every request samples from its own torch.Generator seeded with
`sampling_seed` (or engine seed + a stable hash of its rid), so its tokens do not depend on the other
requests in the batch (on CPU fp32; GPU kernels are not made batch-invariant). Without it, requests
that pass `sampling_seed` still get their own generator; the rest share the engine's generator.

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
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
import zlib
from collections.abc import Iterable, Iterator

import torch

from miles.engines.embedded import fp8
from miles.engines.embedded.checkpoint import iter_safetensors, read_config
from miles.engines.embedded.fp8_checkpoint import load_fp8_model
from miles.engines.embedded.logprob_extras import Extras, ExtrasRequest, check_request, extras_of
from miles.engines.embedded.lora import AdapterMerger
from miles.engines.embedded.model import CausalLM
from miles.engines.embedded.moe import check_routed_request, routed_buffer
from miles.engines.embedded.prefix_cache import DEFAULT_PAGE_SIZE
from miles.engines.embedded.runner import ModelRunner
from miles.engines.embedded.sampler import SamplingParams
from miles.engines.embedded.scheduler import Request, Scheduler, input_extras
from miles.utils.routing import encode_sglang
from miles.weights.colocated_direct import SharedWeights, wait_for_writer

logger = logging.getLogger(__name__)

_MEMORY_TAGS = frozenset({"weights", "kv_cache", "cuda_graph"})
# Prompts up to this many characters are tokenised on the event loop (about a millisecond); longer
# ones in a thread, so one huge prompt does not stall every other request.
INLINE_TOKENIZE_CHARS = 4096


def _resolve_dtype(dtype: str, config: dict, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        if device.type == "cpu":
            return torch.float32  # CPU bf16 matmuls are slow and the tests need fp32 numerics
        dtype = str(config.get("dtype") or config.get("torch_dtype") or "bfloat16")
        if dtype == "float32":
            dtype = "bfloat16"
    value = getattr(torch, dtype.replace("torch.", ""), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"dtype={dtype!r} is not a torch dtype; use auto, float32, bfloat16 or float16")
    return value


# Without --max-total-tokens, a CPU engine's KV cache takes at most this share of the available memory
# (64 slots of 4096 tokens is 12 GB for a 135M-parameter model: a GPU's default, not a laptop's).
CPU_KV_MEMORY_FRACTION = 0.25


def _cpu_slot_len(spec, dtype: torch.dtype, slots: int, wanted: int) -> int:
    """Tokens per slot for a CPU cache sized by default: `wanted`, or what fits the memory share."""
    import psutil

    per_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * dtype.itemsize
    fit = int(CPU_KV_MEMORY_FRACTION * psutil.virtual_memory().available // (slots * per_token))
    if fit >= wanted:
        return wanted
    fit = max(fit, 2)
    logger.warning(
        "KV cache on CPU: %d slots x %d tokens would exceed %.0f%% of the available memory; each slot holds %d "
        "tokens (set --max-total-tokens, or fewer --max-running-requests, to choose)",
        slots, wanted, 100 * CPU_KV_MEMORY_FRACTION, fit,
    )  # fmt: skip
    return fit


def check_kv_fits(spec, dtype: torch.dtype, device: torch.device, slots: int, slot_len: int) -> None:
    """Refuse (ValueError) a KV cache of `slots` x `slot_len` tokens larger than the device's memory, naming
    the most tokens that would fit: allocating it would die in the allocator (or the OOM killer) instead."""
    per_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * dtype.itemsize
    if device.type == "cuda":
        total = torch.cuda.mem_get_info(device)[1]
        where = f"{device}'s"
    else:
        import psutil

        total, where = psutil.virtual_memory().total, "this host's"
    need = slots * slot_len * per_token
    if need > total:
        raise ValueError(
            f"max_total_tokens={slots * slot_len} needs a {need / 2**30:.1f} GiB KV cache ({per_token} bytes a token), "
            f"more than {where} {total / 2**30:.1f} GiB; at most {total // per_token} tokens fit (fewer with the "
            "weights): lower --max-total-tokens"
        )


class EmbeddedEngine:
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
    ):
        """prefix_cache_tokens: the shared pages' pool size in tokens (default: a quarter of the slots'
        capacity, max_running_requests x max_seq_len / 4). quantization "fp8" (SGLang's --quantization):
        serve a bf16 checkpoint in FP8, quantized per block at load; an FP8 checkpoint is served in FP8
        without it."""
        from miles.utils.timer import PhaseClock
        from miles.utils.tokenizer_file import load_engine_tokenizer

        clock = PhaseClock()

        self.model_path = model_path
        self.device = torch.device(device)
        config = read_config(model_path)
        self.dtype = _resolve_dtype(dtype, config, self.device)
        self.tokenizer = load_engine_tokenizer(model_path)  # no transformers import where the file suffices
        clock.mark("tokenizer")
        if quantization not in (None, "fp8"):
            raise ValueError(f"quantization={quantization!r}: the embedded engine serves fp8 (or none)")
        fp8_checkpoint = fp8.is_fp8_config(config)  # an FP8 rollout checkpoint (fp8.py): e4m3 weights, W8A8 GEMMs
        self.fp8 = fp8_checkpoint or quantization == "fp8"
        if self.fp8 and true_on_policy:
            raise ValueError(
                "--true-on-policy-mode needs the trainer's exact weights; serve a bf16 checkpoint, not FP8"
            )
        if fp8_checkpoint:
            self.model = load_fp8_model(model_path, self.device, self.dtype)
        else:
            self.model = CausalLM.from_pretrained(model_path, self.device, self.dtype)
            if self.fp8:
                self.model.quantize_fp8()
        clock.mark("weights")
        max_seq_len = min(self.model.spec.max_position_embeddings, 4096)
        if max_total_tokens is None and self.device.type == "cpu":
            max_seq_len = _cpu_slot_len(self.model.spec, self.dtype, max_running_requests, max_seq_len)
        if max_total_tokens is not None:
            max_seq_len = max_total_tokens // max_running_requests
            if max_seq_len < 2:
                raise ValueError(
                    f"max_total_tokens={max_total_tokens} gives {max_seq_len} tokens per slot for "
                    f"max_running_requests={max_running_requests}; raise max_total_tokens"
                )
            check_kv_fits(self.model.spec, self.dtype, self.device, max_running_requests, max_seq_len)
        self.max_seq_len = max_seq_len
        # No token spans more characters than the longest vocabulary entry, so a longer text cannot fit
        # the context and is refused before tokenising (x2: normalizers may fold characters).
        self.max_prompt_chars = 2 * max_seq_len * max((len(t) for t in self.tokenizer.get_vocab()), default=1)
        self.runner = ModelRunner(
            self.model,
            max_running_requests=max_running_requests,
            max_seq_len=max_seq_len,
            # None = on where they work (CUDA, dense models): about 3x faster decode than eager
            use_cuda_graphs=cuda_graphs if cuda_graphs is not None else self._graphs_supported(),
            fused_kernels=fused_kernels,
            prefix_cache_pages=self._prefix_pages(prefix_cache, prefix_cache_tokens, max_running_requests),
        )
        clock.mark("runner")
        self.seed = seed
        self.deterministic = deterministic
        self.eos_ids = self._eos_ids(config)
        self._weight_version = 0
        self._shared = SharedWeights(self.device)  # the shared weight buffer, once a direct update asked for it
        tied = frozenset({"lm_head.weight"}) if self.model.spec.tie_word_embeddings else frozenset()
        self.adapter = AdapterMerger(self.model.params, tied)  # LoRA: the adapter merged into the base (lora.py)
        self._repack_on_resume = False
        self._children: dict[str, list[str]] = {}
        self._batch_generator = torch.Generator(device=self.device).manual_seed(seed)
        self.scheduler: Scheduler | None = None
        self._task: asyncio.Task | None = None
        self._max_prefill_tokens = max_prefill_tokens
        # None = with CUDA graphs, where the GPU runs ahead of the host (see scheduler.py)
        self._lookahead = self.runner.use_cuda_graphs if lookahead is None else lookahead
        # CPU decode steps of tiny models are shorter than a thread hand-off: run those on the loop
        self._inline_step_s = (
            inline_step_s if inline_step_s is not None else (0.003 if self.device.type == "cpu" else 0.0)
        )
        # --true-on-policy-mode: prefill-only scoring goes through the trainer's reference forward
        self.reference = None
        if true_on_policy:
            from miles.engines.embedded.reference import ReferenceModel

            self.reference = ReferenceModel(model_path, self.model)
        logger.info("engine built in %s", clock.summary())

    def _prefix_pages(self, enabled: bool, tokens: int | None, slots: int) -> int:
        if not enabled:
            return 0
        tokens = slots * self.max_seq_len // 4 if tokens is None else tokens
        if tokens < DEFAULT_PAGE_SIZE:
            raise ValueError(
                f"prefix_cache_tokens={tokens} holds no {DEFAULT_PAGE_SIZE}-token page; raise it or disable prefix sharing"
            )
        return tokens // DEFAULT_PAGE_SIZE

    def prefix_cache_stats(self) -> dict:
        """Prefill tokens requested and computed since the start, and the pool's pages (cached, referenced)."""
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
        }

    def _graphs_supported(self) -> bool:
        return self.device.type == "cuda" and not self.model.spec.moe_layers

    def _eos_ids(self, config: dict) -> frozenset[int]:
        ids = config.get("eos_token_id")
        ids = [ids] if isinstance(ids, int) else list(ids or [])
        if self.tokenizer.eos_token_id is not None:
            ids.append(self.tokenizer.eos_token_id)
        return frozenset(ids)

    # ---- lifecycle ---------------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._task is not None:
            raise RuntimeError("EmbeddedEngine.start() called twice")
        self.scheduler = Scheduler(
            self.runner,
            check_stop_strings=self._check_stop_strings,
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
        if (input_ids is None) == (text is None):
            raise ValueError("pass exactly one of input_ids or text")
        prompt = self._check_prompt(list(input_ids) if input_ids is not None else await self._encode(text), params)
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
        if params.n > self.runner.max_running_requests:
            raise ValueError(
                f"n={params.n} is over the engine's {self.runner.max_running_requests} running requests "
                "(max_running_requests); ask for fewer samples per request"
            )
        rids = [rid] if params.n == 1 else [f"{rid}-{i}" for i in range(params.n)]
        if params.n > 1:
            self._children[rid] = rids
        loop = asyncio.get_running_loop()
        reqs = [
            Request(
                rid=r,
                prompt_ids=prompt,
                params=params,
                return_logprob=return_logprob,
                logprob_start_len=logprob_start_len,
                future=loop.create_future(),
                generator=self._request_generator(params, r, i),
                stop_ids=frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_ids),
                extras=extras,
                routed=routed_buffer(self.model.spec, routed_capacity),
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
        outs = [self._response(req) for req in done]
        return outs[0] if params.n == 1 else outs

    async def _encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"text must be a string, got {type(text).__name__}")
        if len(text) > self.max_prompt_chars:
            raise ValueError(
                f"prompt of {len(text)} characters cannot fit the engine's {self.max_seq_len}-token context per "
                f"request (refused above {self.max_prompt_chars} characters, before tokenising); shorten it"
            )
        if len(text) <= INLINE_TOKENIZE_CHARS:
            return self.tokenizer(text)["input_ids"]
        return (await asyncio.to_thread(self.tokenizer, text))["input_ids"]

    def _check_prompt(self, ids: list[int], params: SamplingParams) -> list[int]:
        if not ids:
            raise ValueError("the prompt is empty; pass at least one token")
        vocab = self.model.spec.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"input_ids contain ids outside [0, {vocab}): {bad[:5]}")
        limit = self.max_seq_len - (1 if params.max_new_tokens > 0 else 0)
        if len(ids) > limit:
            raise ValueError(
                f"prompt of {len(ids)} tokens does not fit the engine's {self.max_seq_len}-token "
                f"context per request; shorten it or raise max_total_tokens"
            )
        return ids

    def _request_generator(self, params: SamplingParams, rid: str, index: int) -> torch.Generator | None:
        if params.sampling_seed is not None:
            seed = params.sampling_seed + index
        elif self.deterministic:
            seed = self.seed + zlib.crc32(rid.encode())  # stable across processes, unlike hash()
        else:
            return None
        return torch.Generator(device=self.device).manual_seed(seed)

    def _check_stop_strings(self, req: Request) -> dict | None:
        """A stop string in the output's tail (the scheduler checks stop ids and lengths itself)."""
        p = req.params
        window = 4 * max(len(s) for s in p.stop) + 4  # a token decodes to >= 1 char or a byte piece
        tail = self.tokenizer.decode(req.output_ids[-window:], skip_special_tokens=False)
        for s in p.stop:
            if s in tail:
                return {"type": "stop", "matched": s}
        return None

    def _response(self, req: Request) -> dict:
        p, reason = req.params, req.finish_reason
        ids = req.output_ids
        trim_token = reason.get("type") == "stop" and isinstance(reason.get("matched"), int) and not p.no_stop_trim
        text = self.tokenizer.decode(ids[:-1] if trim_token else ids, skip_special_tokens=p.skip_special_tokens)
        matched = reason.get("matched")
        if isinstance(matched, str) and not p.no_stop_trim and matched in text:
            text = text[: text.index(matched)]
        meta = {
            "id": req.rid,
            "finish_reason": reason,
            "prompt_tokens": len(req.prompt_ids),
            "completion_tokens": len(ids),
            "cached_tokens": req.cached_tokens or 0,
            "weight_version": str(self.weight_version),
            "output_token_weight_versions": list(req.output_versions),
        }
        if req.return_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(req.output_logprobs, ids, strict=True)]
            _put_extras(meta, "output", req.extras, req.output_extras)
            if req.logprob_start_len >= 0:
                tokens = req.prompt_ids[req.logprob_start_len :]
                meta["input_token_logprobs"] = [
                    [lp, t, None] for lp, t in zip(req.input_logprobs or [], tokens, strict=False)
                ]
                _put_extras(meta, "input", req.extras, req.input_extras or Extras())
        if req.routed is not None:  # the last token was never fed: seq_len - 1 rows
            meta["routed_experts"] = encode_sglang(req.routed[req.routed_start : req.seq_len - 1])
        return {"text": text, "output_ids": list(ids), "meta_info": meta}

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
        lps, extra, version = await asyncio.to_thread(
            self._reference_locked, prompt, start, params.temperature, extras
        )
        meta = {
            "id": rid,
            "finish_reason": {"type": "length", "length": 0},
            "prompt_tokens": len(prompt),
            "completion_tokens": 0,
            "cached_tokens": 0,
            "weight_version": str(version),
            "output_token_weight_versions": [],
            "output_token_logprobs": [],
            "input_token_logprobs": [[lp, t, None] for lp, t in zip(lps, prompt[start:], strict=True)],
        }
        _put_extras(meta, "output", extras, Extras())
        _put_extras(meta, "input", extras, extra)
        return {"text": "", "output_ids": [], "meta_info": meta}

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

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the live parameters; any KV computed before is re-prefilled."""
        with self.runner.lock:
            self._require_full_weights("load_weights")
            count = 0
            for name, tensor in named:
                target = self.model.weight_target(name)
                if target is None:
                    raise ValueError(
                        f"unknown weight {name!r}: not a tensor of this {self.model.spec.model_type} "
                        f"model (expected HF checkpoint names like 'model.layers.0.mlp.up_proj.weight')"
                    )
                if tuple(tensor.shape) != tuple(target.shape):
                    raise ValueError(
                        f"shape mismatch for {name!r}: got {tuple(tensor.shape)}, engine has {tuple(target.shape)}"
                    )
                target.copy_(tensor)
                count += 1
            self.runner.invalidate_kv()
        logger.info("loaded %d tensors (weight_version still %d until set)", count, self.weight_version)

    def _require_full_weights(self, what: str) -> None:
        if not self.runner.weights_on_device:
            raise RuntimeError("weights are released; call resume_memory_occupation(['weights']) first")
        if self.adapter.active:
            raise ValueError(
                f"{what} refused: LoRA adapter {self.adapter.name!r} is merged into the weights; "
                "unload it first (/unload_lora_adapter) or push adapters only"
            )

    # ---- LoRA adapters (miles/engines/embedded/lora.py) --------------------------------------------------------
    def load_lora_adapter(self, named: Iterable[tuple[str, torch.Tensor]], config: dict, lora_name: str) -> None:
        """Serve this adapter from now on: its weights merged into the resident base; stale KV is re-prefilled."""
        if self.fp8:
            raise ValueError("LoRA adapters are merged into bf16 weights; this engine serves an FP8 checkpoint")
        with self.runner.lock:
            if not self.runner.weights_on_device:
                raise RuntimeError("weights are released; call resume_memory_occupation(['weights']) first")
            self.adapter.load(named, config, lora_name)
            self.runner.invalidate_kv()

    def unload_lora_adapter(self, lora_name: str) -> None:
        """Back to the base weights."""
        with self.runner.lock:
            if self.adapter.name != lora_name:
                raise ValueError(f"no LoRA adapter {lora_name!r} is loaded (loaded: {self.adapter.name!r})")
            if not self.runner.weights_on_device:
                raise RuntimeError("weights are released; call resume_memory_occupation(['weights']) first")
            self.adapter.unload()
            self.runner.invalidate_kv()

    def load_weights_from_dir(self, path: str) -> None:
        """Install every safetensors tensor of a HF model directory, by HF name."""
        model_type = read_config(path).get("model_type") if _has_config(path) else None
        if model_type not in (None, self.model.spec.model_type):
            raise ValueError(f"{path!r} holds a {model_type} model; this engine runs {self.model.spec.model_type}")
        self.load_weights(iter_safetensors(path))

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """HF name -> the live tensor (an FP8 weight's e4m3 rows: what a noise fill overwrites)."""
        for name, t in self.model.params.items():
            yield name, t.q if isinstance(t, fp8.Fp8Weight) else t

    def dequantized_weights(self) -> Iterator[tuple[str, torch.Tensor, torch.Tensor | None]]:
        """HF name -> (the value the engine computes with, fp32 on its device; the largest elementwise
        distance from the value it was given, None where it is stored exactly)."""
        for name, t in self.model.params.items():
            if isinstance(t, fp8.Fp8Weight):
                dq = t.dequantize()
                yield name, dq, fp8.error_bound(dq, t.scale_inv)
            else:
                yield name, t.float(), None

    # ---- direct colocated updates (miles-only) ---------------------------------------------------------------
    def export_weight_buffer(self, generation: int | None = None) -> dict:
        """Where every HF-named weight lives in the shared weight buffer (packed on first use); see
        colocated_direct.py. A caller that maps `generation` already gets `{generation, unchanged}` if
        it is current. Refused while generating: the trainer writes without any engine lock."""
        self._require_quiet("export_weight_buffer")
        if self.fp8:
            raise ValueError(
                "direct colocated updates write bf16 weights in place; this engine serves FP8 (push instead)"
            )
        with self.runner.lock:
            self._require_full_weights("export_weight_buffer")
            if self._shared.arena is None:
                self._pack_weights(self.model.storage)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # no engine kernel still touches the weights
            aliases = {"lm_head.weight": "model.embed_tokens.weight"} if self.model.spec.tie_word_embeddings else {}
            return self._shared.export(self.model.params, aliases, generation)

    def install_weight_buffer(
        self, generation: int, weight_version: str | int, ready_event: str | None = None
    ) -> None:
        """The trainer wrote into buffer `generation` (on CUDA its copies end at the inter-process event
        `ready_event`, waited for here): drop stale KV, take the version."""
        self._require_quiet("install_weight_buffer")
        wait_for_writer(ready_event, self.device)
        with self.runner.lock:
            self._shared.check_install(generation)
            self.runner.invalidate_kv()
        self.weight_version = int(weight_version)

    def _require_quiet(self, what: str) -> None:
        if self.scheduler is not None and not self.scheduler.paused:
            raise RuntimeError(
                f"{what} refused: generation is not paused ({self.scheduler.num_active} requests); "
                "call pause_generation first (a direct colocated update writes into the live weights)"
            )

    def _pack_weights(self, storage: dict[str, torch.Tensor]) -> None:
        """Storage -> views of one fresh flat buffer on the engine's device (copies from host if released)."""
        self.model.storage = self._shared.pack(storage)
        self.model.rebuild_views()  # params are views into storage
        self.runner.graphs = None  # captured decode graphs hold the old weight addresses

    # ---- memory -------------------------------------------------------------------------------------------
    def _tags(self, tags: list[str] | None) -> set[str]:
        chosen = set(tags) if tags else set(_MEMORY_TAGS)
        unknown = chosen - _MEMORY_TAGS
        if unknown:
            raise ValueError(f"unknown memory tags {sorted(unknown)}; use {sorted(_MEMORY_TAGS)}")
        return chosen

    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        tags_set = self._tags(tags)
        with self.runner.lock:
            if "weights" in tags_set and self._shared.arena is not None and self.device.type == "cuda":
                # The runner moves the views to host memory; then nothing holds the flat buffer.
                self._shared.drop()
                self._repack_on_resume = True
            if "weights" in tags_set and self.reference is not None and self.device.type == "cuda":
                self.reference.release()  # its copies of the weights go too (synced again on the next scoring)
            self.runner.release(tags_set)

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        tags_set = self._tags(tags)
        with self.runner.lock:
            if "weights" in tags_set and self._repack_on_resume and not self.runner.weights_on_device:
                self._pack_weights(self.model.storage)  # host copy -> one new device buffer, no 2x peak
                self.runner.weights_on_device = True
                self._repack_on_resume = False
            self.runner.resume(tags_set)
        if self.scheduler is not None:
            self.scheduler.wake()

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


def _put_extras(meta: dict, side: str, asked: ExtrasRequest, got: Extras) -> None:
    """SGLang's `{side}_top_logprobs` / `{side}_token_ids_logprobs` keys, for what was asked."""
    if asked.top_k > 0:
        meta[f"{side}_top_logprobs"] = got.top or []
    if asked.token_ids:
        meta[f"{side}_token_ids_logprobs"] = got.token_ids or []


def _has_config(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "config.json"))
