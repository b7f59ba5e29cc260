"""Per-tensor digests, and the opt-in check that engines hold exactly what the trainer sent.

`--check-weight-update-equal`: before the first update every engine fills its tensors with
noise, so a tensor a transport forgot to write keeps that noise; after the update the trainer
sends the digest of every tensor it streamed and each engine compares its own tensors against
them. Digests compare bytes, so the check is bit-exact; a mismatch names the tensor and engine.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import zlib
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

import numpy as np
import xxhash

if TYPE_CHECKING:  # torch is imported where a tensor is touched: the controller's HTTP layers import this module
    import torch

logger = logging.getLogger(__name__)

DIGESTS: dict[str, Callable[[memoryview], str]] = {
    "xxh3-128": lambda buf: xxhash.xxh3_128_hexdigest(buf),
    "blake2b": lambda buf: hashlib.blake2b(buf, digest_size=16).hexdigest(),
    "adler32": lambda buf: f"{zlib.adler32(buf):08x}",
}


# The engine-side checker's actions (WeightReceiver.weights_checker); an engine reports them in /server_info
# as "weights_checker_actions", and --check-weight-update-equal needs fill_noise. SGLang's own checker has others.
CHECKER_ACTIONS = ("fill_noise", "snapshot", "compare")


class WeightMismatchError(RuntimeError):
    """An engine tensor differs from the trainer's after a weight update."""


def check_digest_name(algo: str) -> str:
    if algo not in DIGESTS:
        raise ValueError(f"unknown digest {algo!r}; use one of {sorted(DIGESTS)} (--update-weight-digest)")
    return algo


def tensor_bytes(t: torch.Tensor) -> np.ndarray:
    """The tensor's raw bytes as a 1-D uint8 numpy array (host copy only when it lives on a device)."""
    import torch

    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    return t.reshape(-1).view(torch.uint8).numpy()


def digest_bytes(buf: np.ndarray | bytes | memoryview, algo: str = "xxh3-128") -> str:
    return DIGESTS[check_digest_name(algo)](memoryview(buf))


def tensor_digest(t: torch.Tensor, algo: str = "xxh3-128") -> str:
    return digest_bytes(tensor_bytes(t), algo)


def digesting(
    named: Iterable[tuple[str, torch.Tensor]], out: dict[str, str], algo: str
) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass the stream through unchanged, recording each tensor's digest in `out` as it goes by."""
    for name, tensor in named:
        out[name] = tensor_digest(tensor, algo)
        yield name, tensor


# Values per tensor that --check-weight-update-allow-quant-error compares (at seeded positions).
SKETCH_SIZE = 256


def sketch_positions(name: str, numel: int) -> torch.Tensor:
    """The flat positions of a tensor that both sides read: seeded by the name, so no index travels."""
    import torch

    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randint(numel, (min(SKETCH_SIZE, numel),), generator=gen)


def sketching(
    named: Iterable[tuple[str, torch.Tensor]], out: dict[str, list[float]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass the stream through unchanged, recording each tensor's values at its sketch positions (fp32)."""
    for name, tensor in named:
        flat = tensor.detach().reshape(-1)
        out[name] = flat[sketch_positions(name, flat.numel()).to(flat.device)].float().cpu().tolist()
        yield name, tensor


# -- engine side -------------------------------------------------------------------------------


def fill_noise(named: Iterable[tuple[str, torch.Tensor]], seed: int = 1234) -> int:
    """Overwrite every tensor in place with seeded noise; returns the number of tensors filled."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    count = 0
    with torch.no_grad():
        for _, t in named:
            if t.is_floating_point():
                noise = torch.randn(t.shape, generator=gen, dtype=torch.float32)
            else:
                noise = torch.randint(-100, 100, t.shape, generator=gen)
            t.copy_(noise.to(t.dtype))
            count += 1
    return count


def _compare_by_name(
    items: Iterable[tuple], expected: dict, skip: Iterable[str], matches: Callable[..., bool]
) -> dict[str, list[str]]:
    """Walk the engine's (name, *values) items against the trainer's `expected` by name; `matches(name, want,
    *values)` says whether one agrees. Returns {"mismatched", "not_sent" (engine tensors the trainer never
    streamed: they still hold noise), "missing" (trainer names the engine does not have)}."""
    skipped = set(skip)
    mismatched, not_sent, seen = [], [], set()
    for name, *values in items:
        if name in skipped:
            continue
        seen.add(name)
        want = expected.get(name)
        if want is None:
            not_sent.append(name)
        elif not matches(name, want, *values):
            mismatched.append(name)
    missing = sorted(set(expected) - seen - skipped)
    return {"mismatched": mismatched, "not_sent": not_sent, "missing": missing}


def compare_with_digests(
    named: Iterable[tuple[str, torch.Tensor]], expected: dict[str, str], algo: str, skip: Iterable[str] = ()
) -> dict[str, list[str]]:
    """Compare engine tensors with the trainer's digests (bytes equal); the result as `_compare_by_name`'s."""
    return _compare_by_name(named, expected, skip, lambda _name, want, t: tensor_digest(t, algo) == want)


def compare_with_sketches(
    dequantized: Iterable[tuple[str, torch.Tensor, torch.Tensor | None]],
    expected: dict[str, list[float]],
    skip: Iterable[str] = (),
) -> dict[str, list[str]]:
    """Compare an engine's values (name, value, elementwise quantization bound or None) with the trainer's
    sketches: each sampled element within its bound (None: within bf16 rounding, 2^-8 relative).
    A tensor the transport never wrote holds noise, far outside any bound."""
    import torch

    def within(name: str, want: list[float], value: torch.Tensor, bound: torch.Tensor | None) -> bool:
        idx = sketch_positions(name, value.numel()).to(value.device)
        got = value.reshape(-1)[idx].float()
        ref = torch.tensor(want, dtype=torch.float32, device=got.device)
        tol = bound.reshape(-1)[idx] if bound is not None else ref.abs() * 2.0**-8
        return bool(((got - ref).abs() <= tol * (1 + 1e-5) + 1e-12).all())

    return _compare_by_name(dequantized, expected, skip, within)


def compare_with_snapshot(
    named: Iterable[tuple[str, torch.Tensor]], snapshot: dict[str, torch.Tensor], atol: float = 0.0
) -> dict[str, list[str]]:
    """Compare engine tensors with a host snapshot taken earlier (atol=0: bit-exact)."""
    import torch

    mismatched, seen = [], set()
    for name, t in named:
        if name not in snapshot:
            continue
        seen.add(name)
        ref = snapshot[name]
        cur = t.detach().cpu()
        same = torch.equal(cur, ref) if atol == 0 else torch.allclose(cur.float(), ref.float(), rtol=0, atol=atol)
        if not same:
            mismatched.append(name)
    return {"mismatched": mismatched, "not_sent": [], "missing": sorted(set(snapshot) - seen)}


# -- trainer side ------------------------------------------------------------------------------


async def fill_engines_with_noise(engines: list, seed: int = 1234) -> None:
    await asyncio.gather(*(e.weights_checker(action="fill_noise", seed=seed + i) for i, e in enumerate(engines)))


async def check_engines(
    engines: list, expected: dict[str, str], algo: str, skip: Iterable[str] = (), sketches: dict | None = None
) -> None:
    """Ask every engine to compare its tensors with `expected` (with `sketches`: with those, within the
    engine's quantization error); raise naming every engine and tensor that differ."""
    skip = list(skip)
    what = {"sketches": sketches} if sketches is not None else {"digests": expected, "digest": algo}
    results = await asyncio.gather(
        *(e.weights_checker(action="compare", skip_tensor_list=skip, **what) for e in engines)
    )
    problems = []
    for i, (engine, res) in enumerate(zip(engines, results, strict=True)):
        for kind in ("mismatched", "not_sent", "missing"):
            names = res.get(kind) or []
            if names:
                shown = ", ".join(names[:8]) + (f" (+{len(names) - 8} more)" if len(names) > 8 else "")
                problems.append(f"engine {i} ({engine!r}): {kind}: {shown}")
    if problems:
        raise WeightMismatchError(
            "weight update check failed (--check-weight-update-equal): "
            + "; ".join(problems)
            + "; 'mismatched' = bytes differ from the trainer's (beyond the quantization error with "
            "--check-weight-update-allow-quant-error, which an FP8 engine needs), 'not_sent' = the transport never wrote it (still noise), "
            "'missing' = the engine has no tensor of that name"
        )
    logger.info("weight update check passed on %d engines (%d tensors)", len(engines), len(expected))
