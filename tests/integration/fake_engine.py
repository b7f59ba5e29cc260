"""A small stand-in for EmbeddedEngine that follows its in-process contract.

Its "model" is a fixed rule, so tests can compute every expected output by hand: greedy decoding
continues token t with (t * 31 + 7) % VOCAB, each generated token has logprob -0.5 and each input
token after the first has logprob -1.0. Text maps to ids one character at a time (ord % VOCAB).
"""

from __future__ import annotations

import asyncio
import random
import uuid
from typing import Any

VOCAB = 97
EOS = 96


def next_token(token: int) -> int:
    return (token * 31 + 7) % VOCAB


class FakeTokenizer:
    eos_token_id = EOS

    def encode(self, text: str) -> list[int]:
        return [ord(c) % VOCAB for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(32 + i % 90) for i in ids)


class FakeEngine:
    def __init__(self, model_path: str = "fake-model", *, delay_s: float = 0.0, **_: Any) -> None:
        self.model_path = model_path
        self.tokenizer = FakeTokenizer()
        self.delay_s = delay_s
        self.weight_version = 0
        self.max_running_requests = 64
        self.calls: list[dict] = []  # every generate() kwargs, for assertions
        self._active: set[str] = set()
        self._aborted: set[str] = set()
        self._running = asyncio.Event()
        self._running.set()
        self.released: list[str] | None = None
        self.pause_modes: list[str] = []
        self.loaded: list[tuple[str, Any]] = []

    @property
    def num_active_requests(self) -> int:
        return len(self._active)

    async def start(self) -> None:
        pass

    async def shutdown(self) -> None:
        pass

    async def generate(
        self,
        *,
        input_ids: list[int] | None = None,
        text: str | None = None,
        sampling_params: dict | None = None,
        rid: str | None = None,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
    ) -> dict | list[dict]:
        if (input_ids is None) == (text is None):
            raise ValueError("pass exactly one of input_ids / text")
        params = dict(sampling_params or {})
        unknown = set(params) - {
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "max_new_tokens",
            "stop",
            "stop_token_ids",
            "ignore_eos",
            "n",
            "sampling_seed",
            "skip_special_tokens",
            "no_stop_trim",
            "spaces_between_special_tokens",
        }
        if unknown:
            raise ValueError(f"unknown sampling params {sorted(unknown)}")
        self.calls.append(
            dict(
                input_ids=input_ids,
                text=text,
                sampling_params=params,
                rid=rid,
                return_logprob=return_logprob,
                logprob_start_len=logprob_start_len,
            )
        )
        prompt = list(input_ids) if input_ids is not None else self.tokenizer.encode(text)
        n = int(params.get("n", 1))
        rid = rid or uuid.uuid4().hex
        outs = await asyncio.gather(
            *(
                self._one(
                    prompt, params, f"{rid}" if n == 1 else f"{rid}-{i}", rid, i, return_logprob, logprob_start_len
                )
                for i in range(n)
            )
        )
        return outs[0] if n == 1 else list(outs)

    async def _one(self, prompt, params, out_id, rid, index, return_logprob, logprob_start_len) -> dict:
        self._active.add(out_id)
        try:
            max_new = int(params.get("max_new_tokens", 16))
            stop_ids = set(params.get("stop_token_ids") or [])
            temperature = float(params.get("temperature", 1.0))
            rng = random.Random(params.get("sampling_seed", 0) * 1000 + index)
            out: list[int] = []
            finish = {"type": "length", "length": max_new}
            last = prompt[-1]
            for _ in range(max_new):
                await self._running.wait()
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                if rid in self._aborted or out_id in self._aborted:
                    finish = {"type": "abort", "message": "aborted"}
                    break
                tok = next_token(last) if temperature == 0 else rng.randrange(VOCAB)
                out.append(tok)
                last = tok
                if tok in stop_ids or (tok == EOS and not params.get("ignore_eos")):
                    finish = {"type": "stop", "matched": tok}
                    break
            meta = {
                "id": out_id,
                "finish_reason": finish,
                "prompt_tokens": len(prompt),
                "completion_tokens": len(out),
                "cached_tokens": 0,
                "weight_version": str(self.weight_version),
                "output_token_weight_versions": [self.weight_version] * len(out),
            }
            if return_logprob:
                meta["output_token_logprobs"] = [[-0.5, t, None] for t in out]
                if logprob_start_len >= 0:
                    meta["input_token_logprobs"] = [
                        [None if i == 0 else -1.0, t, None] for i, t in enumerate(prompt) if i >= logprob_start_len
                    ]
            return {"text": self.tokenizer.decode(out), "output_ids": out, "meta_info": meta}
        finally:
            self._active.discard(out_id)

    def abort(self, rid: str | None = None, abort_all: bool = False) -> None:
        if abort_all:
            self._aborted.update(self._active)
        elif rid is not None:
            self._aborted.add(rid)

    async def pause_generation(self, mode: str = "retract") -> None:
        self.pause_modes.append(mode)
        if mode == "abort":
            self.abort(abort_all=True)
        self._running.clear()

    async def continue_generation(self) -> None:
        self._running.set()

    def flush_cache(self) -> bool:
        return not self._active

    def load_weights(self, named) -> None:
        self.loaded.extend(named)

    def named_weights(self):
        return iter(())

    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        self.released = tags

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        self.released = None

    def model_info(self) -> dict:
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.model_path,
            "is_generation": True,
            "weight_version": str(self.weight_version),
        }
