"""What the tests share: `miles train` as a user runs it, argument lists for small runs, free ports, skips
for optional packages, and CPU stand-ins for GPU arithmetic (the interpreter's rounding, cuBLASLt's FP8 GEMM).

Test modules import from here (`from harness import ...`; `tests/conftest.py` puts this folder on
`sys.path`); the fixtures built on it live in `tests/conftest.py`.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from miles.wire.ports import free_port

__all__ = [
    "DEMO",
    "REPO",
    "SMALL_RUN",
    "cublaslt_scaled_mm",
    "free_port",
    "free_port_run",
    "installed",
    "leftover_processes",
    "make_train_batch",
    "minimal_train_args",
    "prefill_scorer",
    "python_path",
    "read_rows",
    "requires",
    "run_train",
    "round_to_nearest_under_interpreter",
    "run_under_triton_interpreter",
    "train_command",
    "train_env",
]

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "launch" / "configs" / "demo_cpu.yaml"

# A small step of the CPU demo: 4 prompts x 4 samples, one optimizer step of 16, no eval.
SMALL_RUN = (
    "--rollout-batch-size",
    "4",
    "--n-samples-per-prompt",
    "4",
    "--global-batch-size",
    "16",
    "--eval-interval",
    "none",
)

# The pip distribution each optional import comes from, for the skip reason.
EXTRAS = {
    "peft": "miles[lora]",
    "gguf": "miles[gguf]",
    "pyarrow": "miles[parquet]",
    "megatron.core": "miles[megatron]",
    "sglang": "miles[sglang]",
    "matplotlib": "miles[plot]",
    "tensorboard": "miles[tensorboard]",
    "trl": "miles[bench]",
    "datasets": "miles[bench]",
    "openai": "miles[test]",
    "triton": "triton",
    "sympy": "sympy",
    "py_spy": "py-spy",
}


def make_train_batch(seq_lens: list[int], resp_lens: list[int], vocab: int = 1000, seed: int = 0):
    """A TrainBatch of random tokens below `vocab` with these sequence and response lengths (no rewards)."""
    import numpy as np

    from miles.rollout.train_data import TrainBatch

    rng = np.random.default_rng(seed)
    n, t = len(seq_lens), int(sum(resp_lens))
    return TrainBatch(
        tokens=rng.integers(0, vocab, size=sum(seq_lens)),
        seq_lens=np.array(seq_lens),
        response_lengths=np.array(resp_lens),
        loss_masks=np.ones(t, np.float32),
        rewards=np.zeros(n, np.float32),
        raw_rewards=np.zeros(n, np.float32),
        group_index=np.arange(n),
        sample_index=np.arange(n),
        truncated=np.zeros(n, np.int8),
    )


def minimal_train_args(
    *flags: str,
    num_rollout: int = 3,
    rollout_batch_size: int | None = 4,
    hf_checkpoint: str = "/m",
    prompt_data: str = "/p.jsonl",
    objective: tuple[str, str] = ("--rm-type", "math"),
) -> list[str]:
    """The fewest `miles train` flags that pass the start-up checks (model, data, reward, length), then `flags`.

    The paths need not exist: `load_config` does not open them. `objective` is the reward (RL) or
    `("--loss-type", "sft_loss")`; `rollout_batch_size=None` leaves the batch size to `flags`."""
    batch = ["--rollout-batch-size", str(rollout_batch_size)] if rollout_batch_size is not None else []
    return [
        "--hf-checkpoint",
        hf_checkpoint,
        "--prompt-data",
        prompt_data,
        *objective,
        "--num-rollout",
        str(num_rollout),
        *batch,
        *flags,
    ]


def installed(module: str) -> bool:
    """Whether `module` can be imported (a parent package that is missing counts as not installed)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def requires(*modules: str) -> pytest.MarkDecorator:
    """Skip the test (or module, as `pytestmark`) unless every one of `modules` is installed."""
    missing = [m for m in modules if not installed(m)]
    reason = ", ".join(f"{m} ({EXTRAS.get(m, m)})" for m in missing)
    return pytest.mark.skipif(bool(missing), reason=f"needs {reason}")


def free_port_run(count: int, host: str = "127.0.0.1") -> int:
    """A port P with P .. P + count - 1 all free right now (torchrun's store, the controller, a rendezvous)."""
    for _ in range(50):
        port = free_port(host)
        if port + count - 1 > 65535:
            continue
        try:
            for p in range(port + 1, port + count):
                with socket.socket() as s:
                    s.bind((host, p))
        except OSError:
            continue
        return port
    raise RuntimeError(f"no {count} consecutive free ports on {host}")


# ---- `miles train` in a subprocess ----------------------------------------------------------------


def train_command(out_dir: Path, *flags: str, config: Path | None = DEMO) -> list[str]:
    """`miles train` on `config` (the CPU demo; None: flags only) into `out_dir`, with `flags` last (they win).

    No end-of-run PNG curves (a second of drawing per run that these tests do not look at; the plots of a
    run's end are checked in tests/unit/test_cli.py)."""
    if config is not None and "--config" in flags:  # miles refuses two files: say which argument to use
        raise ValueError(
            "train_command: pass the recipe as config=..., not as a --config flag (config=None: flags only)"
        )
    head = [sys.executable, "-m", "miles.cli", "train"]
    head += ["--config", str(config)] if config is not None else []
    return [*head, "--output-dir", str(out_dir), "--no-progress-bar", "--no-plot-curves", *flags]


def python_path() -> str:
    """The repository first, then whatever PYTHONPATH the tests run with (packages installed off site-packages)."""
    return os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)


def train_env(**extra: str) -> dict[str, str]:
    """The environment of a run the tests start: this one, one torch thread, this checkout first on the path."""
    return {**os.environ, "MILES_TORCH_THREADS": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": python_path(), **extra}


def run_train(
    out_dir: Path, *flags: str, timeout_s: float = 600, env: dict | None = None, config: Path | None = DEMO
) -> list[dict]:
    """Run `config` (the CPU demo) with `flags`; return metrics.jsonl rows. Fails with the run's output tail."""
    proc = subprocess.Popen(
        train_command(out_dir, *flags, config=config),
        cwd=REPO,
        env=train_env(**(env or {})),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the workers notice their controller is gone and exit
        stdout, stderr = proc.communicate()
        raise AssertionError(f"miles train did not finish in {timeout_s}s:\n{stderr[-5000:]}") from None
    if proc.returncode != 0:
        raise AssertionError(f"miles train failed ({proc.returncode}):\n{stdout[-3000:]}\n{stderr[-5000:]}")
    return read_rows(out_dir)


def read_rows(out_dir: Path) -> list[dict]:
    """The rows of `out_dir/metrics.jsonl`."""
    from miles.utils.metrics import read_metrics

    return read_metrics(str(out_dir))


def leftover_processes(marker: str) -> list[str]:
    """Processes whose command line or environment mentions `marker` (a run directory), other than this one."""
    found = []
    for p in psutil.process_iter(["pid", "cmdline", "environ"]):
        try:
            text = " ".join(p.info["cmdline"] or []) + " " + " ".join((p.info["environ"] or {}).values())
        except (psutil.Error, TypeError):
            continue
        if marker in text and p.pid != os.getpid():
            found.append(f"{p.pid}: {' '.join(p.info['cmdline'] or [])[:200]}")
    return found


def run_under_triton_interpreter(test_file: str) -> None:
    """Run the tests of `test_file` in a child process with TRITON_INTERPRET=1 (the interpreter must be on
    before triton is imported, so not in this process); assert they passed and only the launching test,
    which skips there, skipped."""
    env = dict(os.environ, TRITON_INTERPRET="1", MILES_TORCH_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    summary = proc.stdout.strip().splitlines()[-1]
    assert re.search(r"\d+ passed, 1 skipped", summary), summary  # only the launching test skips in the child


# Triton dtype names -> (torch dtype, the integer dtype its codes are viewed as in torch and in numpy)
_INTERPRETER_TARGETS = {
    "bf16": ("bfloat16", "int16", "uint16"),
    "fp8e4nv": ("float8_e4m3fn", "uint8", "uint8"),
    "fp8e5": ("float8_e5m2", "uint8", "uint8"),
}


def round_to_nearest_under_interpreter(monkeypatch, names: tuple[str, ...]) -> None:
    """Under Triton's interpreter, make fp32 -> `names` (Triton's dtype names: "bf16", "fp8e4nv", "fp8e5")
    conversions round to nearest even, as the GPU's cvt.rn does, by torch's cast. The interpreter's own
    conversion truncates the mantissa (and drops carries), so a kernel that rounds where the torch code it
    is checked against does would differ from it by the interpreter's error alone. No-op outside it."""
    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        return
    import numpy as np
    import torch
    from triton.runtime import interpreter

    convert = interpreter._convert_float  # noqa: SLF001 - the interpreter's conversion, replaced for `names`

    def rounded(data, input_dtype, output_dtype, rounding_mode):
        if output_dtype.name not in names or input_dtype.name != "fp32":
            return convert(data, input_dtype, output_dtype, rounding_mode)
        torch_dtype, code_dtype, numpy_codes = _INTERPRETER_TARGETS[output_dtype.name]
        codes = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32)).to(getattr(torch, torch_dtype))
        return codes.view(getattr(torch, code_dtype)).numpy().view(numpy_codes).reshape(data.shape)

    monkeypatch.setattr(interpreter, "_convert_float", rounded)


def cublaslt_scaled_mm(a, b, scale_a, scale_b, out_dtype):
    """torch._scaled_mm's 1x128 x 128x128 product as cuBLASLt computes it: the scales are read from memory in
    its layouts, whatever strides the tensors carry: scale_a[m, l] at l * M + m, the weight's block (n, l) at
    n * L4 + l (L4 = K/128 rounded up to a multiple of 4); a read past the storage gives NaN. A stand-in for
    torch._scaled_mm on machines without Hopper (fp32 sums of the dequantized products)."""
    import torch

    M, K = a.shape
    N, L = b.shape[1], K // 128
    L4 = -(-L // 4) * 4

    def raw(t, offsets):
        flat = torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage())
        flat = torch.cat((flat, torch.tensor([float("nan")], device=t.device)))
        return flat[(t.storage_offset() + offsets.to(t.device)).clamp(max=flat.numel() - 1)]

    sa = raw(scale_a, torch.arange(L)[None, :] * M + torch.arange(M)[:, None])  # [M, L]
    sb = raw(scale_b, torch.arange(N // 128)[:, None] * L4 + torch.arange(L)[None, :])  # [NB, L]
    ad = (a.float().view(M, L, 128) * sa[..., None]).view(M, K)
    bd = b.float() * sb.repeat_interleave(128, 0).repeat_interleave(128, 1).t()
    return (ad @ bd).to(out_dtype)


def prefill_scorer(prompt: list[int], ids: list[int]):
    """A body for `with_engine`: the log-prob of each of `ids` after `prompt`, scored by one prefill (the
    engine's forward without reading its cache), as a tensor."""

    async def body(engine):
        import torch

        out = await engine.generate(
            input_ids=prompt + ids,
            sampling_params={"max_new_tokens": 0, "temperature": 1.0},
            return_logprob=True,
            logprob_start_len=0,
        )
        return torch.tensor([lp for lp, _, _ in out["meta_info"]["input_token_logprobs"][len(prompt) :]])

    return body


def with_engine(body, **engine_kwargs):
    """Start an embedded engine with `engine_kwargs`, run `await body(engine)` on a fresh event loop, shut it
    down whatever happens; return what `body` returned."""
    from miles.engines.embedded.engine import EmbeddedEngine

    async def main():
        engine = EmbeddedEngine(**engine_kwargs)
        await engine.start()
        try:
            return await body(engine)
        finally:
            await engine.shutdown()

    return asyncio.run(main())


def extend_batch(model, caches, starts: list[int], lens: list[int], slot0: int, generator) -> tuple:
    """A prefill after cached prefixes, as the engine runs its prefix hits: random sequences whose first
    starts[b] tokens the eager forward writes into slot slot0 + b of every cache in `caches`, then their other
    lens[b] tokens as one padded batch. Returns (tokens, positions, write positions, last index, extend length);
    padding sits at position 0 and writes the scratch position."""
    import torch

    device, vocab = model.device, model.spec.vocab_size
    seqs = [torch.randint(3, vocab, (a + n,), generator=generator).tolist() for a, n in zip(starts, lens, strict=True)]
    for cache in caches:
        for b, a in enumerate(starts):
            if a:
                tok, pos = torch.tensor([seqs[b][:a]], device=device), torch.arange(a, device=device)[None]
                model.forward(
                    tok, pos, cache, slot0 + b, pos, kv_len=None, out_index=torch.tensor([a - 1], device=device)
                )
    width = max(lens)
    tokens = torch.tensor(
        [q[a:] + [0] * (width - n) for q, a, n in zip(seqs, starts, lens, strict=True)], device=device
    )
    offsets = torch.arange(width, device=device)[None]
    valid = offsets < torch.tensor(lens, device=device)[:, None]
    positions = torch.where(valid, offsets + torch.tensor(starts, device=device)[:, None], 0)
    write = torch.where(valid, positions, caches[0].scratch_pos)
    last = torch.tensor(lens, device=device) - 1
    return tokens, positions, write, last, max(a + n for a, n in zip(starts, lens, strict=True))
