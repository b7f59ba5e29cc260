"""From one /generate call to what the scheduler runs: the prompt's token ids (tokenised where it came as
text, checked to fit the context), one rid per sample, each sample's generator, and the stop-string check the
scheduler calls back with. engine.py builds the `Request`s from these; every value of the engine these read
(tokenizer, context length, seed) is passed in.

Determinism: with `deterministic=True` every request samples from its own torch.Generator seeded with
`sampling_seed` (or engine seed + a stable hash of its rid), so its tokens do not depend on the other
requests in the batch (on CPU fp32; GPU kernels are not made batch-invariant). Without it, requests
that pass `sampling_seed` still get their own generator; the rest share the engine's generator.
"""

from __future__ import annotations

import asyncio
import zlib

import torch

from miles.engines.embedded.request import Request
from miles.engines.embedded.sampler import SamplingParams

# Prompts up to this many characters are tokenised on the event loop (about a millisecond); longer
# ones in a thread, so one huge prompt does not stall every other request.
INLINE_TOKENIZE_CHARS = 4096


async def prompt_ids(
    input_ids: list[int] | None,
    text: str | None,
    params: SamplingParams,
    *,
    tokenizer,
    vocab_size: int,
    max_seq_len: int,
    max_prompt_chars: int,
) -> list[int]:
    """The prompt's token ids, from `input_ids` or the tokenised `text` (exactly one), checked to fit."""
    if (input_ids is None) == (text is None):
        raise ValueError("pass exactly one of input_ids or text")
    return _check_prompt(
        list(input_ids) if input_ids is not None else await _encode(tokenizer, text, max_seq_len, max_prompt_chars),
        params,
        vocab_size,
        max_seq_len,
    )


async def _encode(tokenizer, text: str, max_seq_len: int, max_prompt_chars: int) -> list[int]:
    if not isinstance(text, str):
        raise ValueError(f"text must be a string, got {type(text).__name__}")
    if len(text) > max_prompt_chars:
        raise ValueError(
            f"prompt of {len(text)} characters cannot fit the engine's {max_seq_len}-token context per "
            f"request (refused above {max_prompt_chars} characters, before tokenising); shorten it"
        )
    if len(text) <= INLINE_TOKENIZE_CHARS:
        return tokenizer(text)["input_ids"]
    return (await asyncio.to_thread(tokenizer, text))["input_ids"]


def _check_prompt(ids: list[int], params: SamplingParams, vocab: int, max_seq_len: int) -> list[int]:
    if not ids:
        raise ValueError("the prompt is empty; pass at least one token")
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"input_ids contain ids outside [0, {vocab}): {bad[:5]}")
    limit = max_seq_len - (1 if params.max_new_tokens > 0 else 0)
    if len(ids) > limit:
        raise ValueError(
            f"prompt of {len(ids)} tokens does not fit the engine's {max_seq_len}-token "
            f"context per request; shorten it or raise max_total_tokens"
        )
    return ids


def sample_rids(rid: str, n: int, max_running_requests: int) -> list[str]:
    """One rid per sample: `rid` itself for n == 1, else `rid-i` (the engine keeps them as the parent's children,
    so that an abort of `rid` reaches them)."""
    if n > max_running_requests:
        raise ValueError(
            f"n={n} is over the engine's {max_running_requests} running requests "
            "(max_running_requests); ask for fewer samples per request"
        )
    return [rid] if n == 1 else [f"{rid}-{i}" for i in range(n)]


def request_generator(
    params: SamplingParams, rid: str, index: int, *, engine_seed: int, deterministic: bool, device: torch.device
) -> torch.Generator | None:
    """Sample `index`'s own generator (None: it draws from the engine's shared one); see the module doc."""
    if params.sampling_seed is not None:
        seed = params.sampling_seed + index
    elif deterministic:
        seed = engine_seed + zlib.crc32(rid.encode())  # stable across processes, unlike hash()
    else:
        return None
    return torch.Generator(device=device).manual_seed(seed)


def check_stop_strings(tokenizer, req: Request) -> dict | None:
    """A stop string in the output's tail (the scheduler checks stop ids and lengths itself)."""
    p = req.params
    window = 4 * max(len(s) for s in p.stop) + 4  # a token decodes to >= 1 char or a byte piece
    tail = tokenizer.decode(req.output_ids[-window:], skip_special_tokens=False)
    for s in p.stop:
        if s in tail:
            return {"type": "stop", "matched": s}
    return None
