"""megatron-core GPTModel built by miles/trainer/mcore_model.py vs the HF forward, on CPU in fp32.

Tiny Llama / Qwen2 / Qwen3 models are converted (mcore_convert) and run on a THD-packed row of
three sequences; their logits must equal the HF model's run on each sequence alone. Two gloo ranks
run tensor parallelism (with and without sequence parallelism) and compare their gradients.
Skipped where megatron-core does not import; CI unpacks its Python 3.12 wheel for these tests (.ci/run).

megatron-core places a few tensors with `torch.cuda.current_device()` and forks a CUDA RNG
tracker around dropout; `_cpu_shims` points those at the CPU for these tests only.
"""

from __future__ import annotations

import contextlib
import os
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _trainer_harness import start_ranks

from miles.wire.ports import free_port

if os.environ.get("MILES_MCORE_SITE"):  # CI: the py3.12 wheel's pure-Python modules, unpacked (.ci/run)
    sys.path.insert(0, os.environ["MILES_MCORE_SITE"])
if os.environ.get("MILES_REQUIRE_MCORE") == "1":
    import megatron.core  # noqa: F401  (CI installed it: a failure to import is a failure)
else:
    pytest.importorskip("megatron.core")

ARCHS = ("llama", "qwen2", "qwen3")
LENS = (7, 5, 10, 31, 3)  # three SDPA groups: [31], [10, 7, 5], [3]; 56 tokens split over 2 SP ranks


def _cpu_shims() -> None:
    from megatron.core.tensor_parallel import random as tp_random

    torch.cuda.current_device = lambda: "cpu"
    tp_random.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    from miles.models.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("models")
    return {a: make_tiny_model(str(root / a), arch=a, vocab=515, init_std=0.2) for a in ARCHS}


def _run(rank: int, world: int, port: int, path: str, sp: bool, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        out[rank] = _compare(path, tp=world, sp=sp)
    finally:
        dist.destroy_process_group()


def _compare(path: str, *, tp: int, sp: bool) -> dict:
    _cpu_shims()
    from megatron.core import parallel_state
    from transformers import AutoModelForCausalLM

    from miles.trainer import mcore_convert as mc
    from miles.trainer import mcore_model as mm

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    try:
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        s = mc.model_shape(hf.config)
        cfg = mm.transformer_config(s, tp=tp, pp=1, cp=1, sequence_parallel=sp, on_gpu=False, recompute=False)
        model = mm.build_gpt_model(s, cfg, num_stage_layers=s.num_layers, pre=True, post=True)
        rank = parallel_state.get_tensor_model_parallel_rank()
        hf_sd = {n: p.detach() for n, p in hf.named_parameters()}
        weights = mc.to_mcore(hf_sd, s, layers=range(s.num_layers), pre=True, post=True, tp_rank=rank, tp_size=tp)
        missing, unexpected = model.load_state_dict(weights, strict=False)
        assert not [k for k in missing if not k.endswith("_extra_state")] and not unexpected
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, s.vocab_size, (sum(LENS),), generator=gen)
        pos = torch.cat([torch.arange(n) for n in LENS])
        logits = model(
            ids[None],
            pos[None],
            None,
            packed_seq_params=mm.packed_seq_params(list(LENS), torch.device("cpu")),
            output_processor=mm.response_logits,
            output_processor_context={"logits_index": torch.arange(sum(LENS)), "vocab_size": s.vocab_size},
        )
        starts = [sum(LENS[:i]) for i in range(len(LENS))]
        ref = torch.cat([hf(input_ids=ids[st : st + n][None]).logits[0] for st, n in zip(starts, LENS, strict=True)])
        logits.pow(2).mean().backward()
        ref.pow(2).mean().backward()
        # fc2 of layer 0 is row-parallel: rank r holds columns r of down_proj
        grad = model.decoder.layers[0].mlp.linear_fc2.weight.grad
        ref_grad = hf.model.layers[0].mlp.down_proj.weight.grad.chunk(tp, dim=1)[rank]
        return {
            "logits_max_diff": float((logits - ref).abs().max()),
            "logits_scale": float(ref.abs().max()),
            "grad_max_diff": float((grad - ref_grad).abs().max()),
            "grad_scale": float(ref_grad.abs().max()),
        }
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("arch", ARCHS)
def test_one_rank_matches_hf(model_dirs, arch):
    out = mp.Manager().dict()
    start_ranks(_run, (1, free_port(), model_dirs[arch], False, out), 1)
    r = out[0]
    assert r["logits_scale"] > 1.0  # a model whose logits carry signal
    assert r["logits_max_diff"] <= 1e-4 * r["logits_scale"]
    assert r["grad_max_diff"] <= 1e-4 * r["grad_scale"]


@pytest.mark.parametrize(("arch", "sp"), [("qwen2", False), ("qwen3", True)])
def test_two_tensor_parallel_ranks_match_hf(model_dirs, arch, sp):
    out = mp.Manager().dict()
    start_ranks(_run, (2, free_port(), model_dirs[arch], sp, out), 2)
    for rank in range(2):
        r = out[rank]
        assert r["logits_max_diff"] <= 1e-4 * r["logits_scale"], rank
        assert r["grad_max_diff"] <= 1e-4 * r["grad_scale"], rank


def test_attention_groups_cover_every_token_once_and_bound_padding():
    from miles.trainer import mcore_model as mm

    rng = np.random.default_rng(0)
    for lens in ([5], [3, 3, 3], [200, 3, 3, 40, 41, 39, 7], list(rng.integers(1, 300, size=64))):
        lens = [int(n) for n in lens]
        rows = mm.packed_seq_params(lens, torch.device("cpu"))
        token = torch.arange(sum(lens))[:, None, None]  # each packed token's own index, as [t, heads, d]
        gathered = torch.cat([g.put(g.take(token)) for g in rows.groups]).flatten()
        in_packed_order = gathered if rows.inverse is None else gathered[rows.inverse]
        assert torch.equal(in_packed_order, torch.arange(sum(lens)))  # every token once, back in packed order
        for g in rows.groups:
            padded, real = g.n * g.width, g.n * g.width if g.keep is None else g.keep.numel()
            assert g.n == 1 or padded <= mm.PAD_WASTE * real
        starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
        assert torch.equal(rows.positions, torch.cat([torch.arange(n) for n in lens]))
        assert rows.cu_seqlens_q.tolist() == [*starts.tolist(), sum(lens)]
    # equal lengths: one group read as a view of the packed row, nothing gathered or reordered
    rows = mm.packed_seq_params([4, 4, 4], torch.device("cpu"))
    assert [(g.n, g.width, g.gather, g.keep) for g in rows.groups] == [(3, 4, None, None)] and rows.inverse is None
