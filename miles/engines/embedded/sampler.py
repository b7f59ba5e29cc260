"""Sampling parameters (SGLang names) and batched sampling.

Log-prob convention (as SGLang): the returned log-prob of a token is taken from
log_softmax(logits / temperature), i.e. after temperature scaling and before top-k/top-p/min-p
truncation. Greedy requests (temperature 0) report log_softmax(logits). The trainer divides its logits
by the rollout temperature too, so both sides score the same distribution.

Sampling is by inverse CDF: one uniform draw per row, scaled by the row's total (truncated, unnormalised)
mass and located in its cumulative sum. One random number per token keeps sampling cheap on CPU and
lets a request with its own torch.Generator draw from it alone, so its samples do not depend on which
other requests share the batch.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch

from miles.engines.embedded.transfer import to_device

logger = logging.getLogger(__name__)

# SGLang sampling fields that change nothing in this engine; accepted so SGLang payloads pass through.
_IGNORED_FIELDS = frozenset(
    {
        "spaces_between_special_tokens",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "min_new_tokens",
        "regex",
        "json_schema",
        "ebnf",
        "logit_bias",
        "custom_params",
        "stream_interval",
    }
)


# Request limits, stated in docs/engines.md: stop strings are searched in each step's output tail.
MAX_STOP = 32
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_new_tokens: int = 128
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1
    sampling_seed: int | None = None
    skip_special_tokens: bool = True
    no_stop_trim: bool = False

    @classmethod
    def from_dict(cls, d: dict | None) -> SamplingParams:
        d = dict(d or {})
        p = cls()
        for key, value in d.items():
            if key in _IGNORED_FIELDS or value is None:
                continue
            if key not in cls.__dataclass_fields__:
                raise ValueError(f"unknown sampling param {key!r}; supported: {sorted(cls.__dataclass_fields__)}")
            setattr(p, key, value)
        if isinstance(p.stop, str):
            p.stop = [p.stop]
        p.stop = [s for s in p.stop if s]
        try:
            p.stop_token_ids = [int(t) for t in p.stop_token_ids]
            p.temperature, p.top_p, p.min_p = float(p.temperature), float(p.top_p), float(p.min_p)
            p.top_k, p.max_new_tokens, p.n = int(p.top_k), int(p.max_new_tokens), int(p.n)
        except (TypeError, OverflowError) as exc:  # a list or an infinite count: bad input, not a crash
            raise ValueError(f"bad sampling params: {exc}") from exc
        p.validate()
        return p

    def validate(self) -> None:
        for name in ("temperature", "top_p", "min_p"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name}={getattr(self, name)} must be a finite number")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p={self.min_p} must be in [0, 1]")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k={self.top_k} must be -1 (off) or >= 1")
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 0 (0 = prefill-only scoring)")
        if self.n < 1:
            raise ValueError(f"n={self.n} must be >= 1")
        if len(self.stop) > MAX_STOP or any(not isinstance(t, str) or len(t) > MAX_STOP_CHARS for t in self.stop):
            raise ValueError(f"stop: at most {MAX_STOP} strings of at most {MAX_STOP_CHARS} characters each")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids holds {len(self.stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS}")
        seed = self.sampling_seed
        if seed is not None and not (isinstance(seed, int) and not isinstance(seed, bool) and 0 <= seed < 2**63):
            raise ValueError(f"sampling_seed={seed!r} must be an integer in [0, 2**63)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


def _truncate(probs: torch.Tensor, limits: Truncation) -> torch.Tensor:
    """Zero the probabilities that top-k, top-p (nucleus, keeping the token that crosses p) or min-p drop."""
    sorted_p, order = probs.sort(dim=-1, descending=True)
    drop = torch.zeros_like(sorted_p, dtype=torch.bool)
    if limits.top_k is not None:
        drop |= torch.arange(probs.shape[-1], device=probs.device)[None, :] >= limits.top_k[:, None]
    if limits.top_p is not None:
        drop |= (sorted_p.cumsum(dim=-1) - sorted_p) > limits.top_p[:, None]
    if limits.min_p is not None:
        drop |= sorted_p < limits.min_p[:, None] * sorted_p[:, :1]
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_p)


@dataclass(slots=True)
class Truncation:
    """A batch's top-k [B] (int64; rows without one keep the whole vocabulary), top-p and min-p [B] (fp32)
    on the device; None where no row of the batch uses that limit."""

    top_k: torch.Tensor | None
    top_p: torch.Tensor | None
    min_p: torch.Tensor | None


def _inverse_cdf(
    probs: torch.Tensor, generators: list[torch.Generator | None], batch_generator: torch.Generator | None
) -> torch.Tensor:
    # fp64 scan on CPU (cheap there); fp32 on GPU, where the parallel scan's error is ~log2(V) ulps
    dtype = torch.float64 if probs.device.type == "cpu" else torch.float32
    u = _uniforms(probs.shape[0], probs.device, generators, batch_generator, dtype)
    cdf = probs.cumsum(dim=-1, dtype=dtype)
    target = (u * cdf[:, -1])[:, None]
    # first index whose cumulative mass exceeds the target: zero-probability tokens are never chosen
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    return tokens.clamp_(max=probs.shape[-1] - 1)


def _uniforms(
    n: int, device: torch.device, generators: list[torch.Generator | None], batch_generator, dtype: torch.dtype
) -> torch.Tensor:
    u = torch.rand(n, device=device, generator=batch_generator, dtype=dtype)
    if generators.count(None) == len(generators):  # the usual batch: no seeded request (counted in C)
        return u
    for i, g in enumerate(generators):
        if g is not None:
            u[i] = torch.rand((), device=device, generator=g, dtype=dtype)
    return u


def _truncates(p: SamplingParams) -> bool:
    return p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0


class SamplingBatch:
    """A batch's sampling parameters with what each step derives from them, computed once: the
    scheduler reuses it while the same requests run in the same order."""

    def __init__(self, params: list[SamplingParams]):
        self.temps = [p.temperature if p.temperature > 0 else 1.0 for p in params]
        self.greedy = [p.greedy for p in params]
        self.top_k = [p.top_k for p in params]
        self.top_p = [p.top_p for p in params]
        self.min_p = [p.min_p for p in params]
        self.all_greedy, self.any_greedy = all(self.greedy), any(self.greedy)
        self.unit_temps = all(t == 1.0 for t in self.temps)
        self.truncates = any(_truncates(p) for p in params)
        self._tensors: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self._truncation: dict[tuple[torch.device, int], Truncation] = {}
        self._fused_inputs: tuple[torch.device, torch.Tensor] | None = None

    def tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(temperatures [B] fp32, greedy flags [B] bool) on `device`."""
        if device not in self._tensors:
            self._tensors[device] = (
                to_device(self.temps, device, torch.float32),
                to_device(self.greedy, device, torch.bool),
            )
        return self._tensors[device]

    def truncation(self, device: torch.device, vocab: int) -> Truncation:
        """The batch's top-k / top-p / min-p limits on `device`, built once (not at every step)."""
        key = (device, vocab)
        if key not in self._truncation:
            ks, ps, ms = self.top_k, self.top_p, self.min_p
            self._truncation[key] = Truncation(
                to_device([k if k > 0 else vocab for k in ks], device) if any(k > 0 for k in ks) else None,
                to_device(ps, device, torch.float32) if any(p < 1.0 for p in ps) else None,
                to_device(ms, device, torch.float32) if any(m > 0 for m in ms) else None,
            )
        return self._truncation[key]

    def fused_inputs(self, device: torch.device) -> torch.Tensor:
        """[2, B] fp32 on `device`: 1 / temperature, greedy flag (one pinned copy, not waited for)."""
        if self._fused_inputs is None or self._fused_inputs[0] != device:
            rows = [[1.0 / t for t in self.temps], [float(g) for g in self.greedy]]
            self._fused_inputs = (device, to_device(rows, device, torch.float32))
        return self._fused_inputs[1]


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams] | SamplingBatch,
    generators: list[torch.Generator | None],
    batch_generator: torch.Generator | None = None,
    fused: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of logits [B, V]; return (token_ids [B], logprobs [B]) on logits.device.

    fused: use the Triton sampler (same inverse-CDF rule, reading the logits about twice instead of
    five times, bf16 logits as they are) when no row truncates (top-k/top-p/min-p); truncating batches
    take the torch path."""
    batch = params if isinstance(params, SamplingBatch) else SamplingBatch(params)
    device = logits.device
    if fused and not batch.truncates:
        from miles.engines.embedded import triton_ops

        inputs = batch.fused_inputs(device)
        u = _uniforms(len(batch.temps), device, generators, batch_generator, torch.float32)
        return triton_ops.sample_rows(logits, inputs[0], u, inputs[1])
    logits = logits.float()  # a no-op for fp32; bf16 logits of the fused decode path
    temps, is_greedy = batch.tensors(device)
    scaled = logits if batch.unit_temps else logits / temps[:, None]
    probs = torch.softmax(scaled, dim=-1)
    if batch.all_greedy:
        tokens = logits.argmax(dim=-1)
    else:
        kept = _truncate(probs, batch.truncation(device, probs.shape[-1])) if batch.truncates else probs
        tokens = _inverse_cdf(kept, generators, batch_generator)
        if batch.any_greedy:
            tokens = torch.where(is_greedy, logits.argmax(dim=-1), tokens)
    # log_softmax at the chosen tokens; a chosen token's probability is never 0 or subnormal in practice
    # (the inverse CDF never picks a zero-mass token), so the log loses nothing to the rounding of p
    return tokens, probs.gather(-1, tokens[:, None]).squeeze(-1).log_()


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """log p(targets[i] | logits[i]) under log_softmax(logits / temperature) (temperature 0 -> 1)."""
    t = temperature if temperature > 0 else 1.0
    scaled = logits if t == 1.0 else logits / t
    return torch.log_softmax(scaled, dim=-1).gather(-1, targets[:, None]).squeeze(-1)
