"""megatron-core MoE (miles/trainer/mcore_moe.py) on a tiny random qwen3_moe, on CPU in fp32 over gloo.

- One rank: the megatron model's logits and gradients equal the HF model's on a packed row of sequences.
- R3: with a rollout routing given, the megatron routers use exactly those experts (routing mismatch 0,
  while the routers' own top-k differs), and the logits equal HF's under the FSDP replay of the same routing.
- Expert parallelism: EP=2 over two gloo ranks (each its half of the sequences, data-parallel for the
  dense weights) gives the log-probs of EP=1 on one rank, and after one step of megatron-core's DDP and
  optimizer the same weights, exported to HF names by the backend's own gather (megatron_weights).

megatron-core's alltoall token dispatcher copies its split sizes to the host on a CUDA side stream; on CPU
`_cpu_shims` stands a host no-op in for that stream (the copies are host-to-host). It also points
`torch.cuda.current_device()` at the CPU and skips the CUDA RNG tracker, as test_mcore_model_cpu.py does.
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

from miles.wire.ports import free_port

if os.environ.get("MILES_MCORE_SITE"):  # CI: the py3.12 wheel's pure-Python modules, unpacked (.ci/run)
    sys.path.insert(0, os.environ["MILES_MCORE_SITE"])
if os.environ.get("MILES_REQUIRE_MCORE") == "1":
    import megatron.core  # noqa: F401  (CI installed it: a failure to import is a failure)
else:
    pytest.importorskip("megatron.core")

LENS = (7, 5, 10, 9)  # ranks of EP=2 take sequences {0, 1} and {2, 3}
RESP = 4  # the last RESP tokens of each sequence are the response


class _HostStream:
    """What the dispatcher asks of its DtoH stream, on a host where every tensor already is on the host."""

    def wait_stream(self, _other) -> None: ...

    def record_event(self) -> _HostStream:
        return self

    def synchronize(self) -> None: ...


def _cpu_shims() -> None:
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    stream = _HostStream()
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.current_stream = lambda *a, **k: stream
    torch.cuda.stream = lambda _s: contextlib.nullcontext()
    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = stream
    tp_random.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    from miles.models.tiny import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("qwen3_moe")), arch="qwen3_moe", vocab=515, init_std=0.2)


def _spawn(fn, world: int, *args) -> dict:
    out = mp.Manager().dict()
    mp.spawn(_worker, args=(world, free_port(), fn, args, out), nprocs=world)
    return dict(out)


def _worker(rank: int, world: int, port: int, fn, args: tuple, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    _cpu_shims()
    from megatron.core import parallel_state

    try:
        out[rank] = fn(*args)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def _build(path: str, ep: int):
    """(HF model, shape, megatron GPTModel holding this EP rank's experts) with expert parallel size `ep`."""
    from megatron.core import parallel_state
    from transformers import AutoModelForCausalLM

    from miles.trainer import mcore_convert as mc
    from miles.trainer import mcore_model as mm

    parallel_state.initialize_model_parallel(expert_model_parallel_size=ep)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    s = mc.model_shape(hf.config)
    cfg = mm.transformer_config(s, tp=1, pp=1, cp=1, sequence_parallel=False, on_gpu=False, recompute=False, ep=ep)
    model = mm.build_gpt_model(s, cfg, num_stage_layers=s.num_layers, pre=True, post=True)
    hf_sd = {n: p.detach() for n, p in hf.named_parameters()}  # transformers' fused expert tensors
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    weights = mc.to_mcore(hf_sd, s, layers=range(s.num_layers), pre=True, post=True, ep_rank=ep_rank, ep_size=ep)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not [k for k in missing if not k.endswith("_extra_state")] and not unexpected
    return hf, s, model


def _tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (sum(LENS),), generator=torch.Generator().manual_seed(0))


def _forward(model, s, ids: torch.Tensor, lens: list[int], logits_index: torch.Tensor) -> torch.Tensor:
    from miles.trainer import mcore_model as mm

    pos = torch.cat([torch.arange(n) for n in lens])
    return model(
        ids[None],
        pos[None],
        None,
        packed_seq_params=mm.packed_seq_params(lens, torch.device("cpu")),
        output_processor=mm.response_logits,
        output_processor_context={"logits_index": logits_index, "vocab_size": s.vocab_size},
    )


def _hf_logits(hf, ids: torch.Tensor, lens: list[int]) -> torch.Tensor:
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
    return torch.cat([hf(input_ids=ids[st : st + n][None]).logits[0] for st, n in zip(starts, lens, strict=True)])


def _matches_hf(path: str) -> dict:
    hf, s, model = _build(path, ep=1)
    ids, lens = _tokens(s.vocab_size), list(LENS)
    logits = _forward(model, s, ids, lens, torch.arange(sum(lens)))
    ref = _hf_logits(hf, ids, lens)
    logits.pow(2).mean().backward()
    ref.pow(2).mean().backward()
    mlp, hf_mlp = model.decoder.layers[0].mlp, hf.model.layers[0].mlp
    grads = [  # router, and expert 3's down projection (HF's fused [E, D, I] tensor)
        (mlp.router.weight.grad, hf_mlp.gate.weight.grad),
        (mlp.experts.local_experts[3].linear_fc2.weight.grad, hf_mlp.experts.down_proj.grad[3]),
    ]
    return {
        "logits": float((logits - ref).abs().max() / ref.abs().max()),
        "grads": [float((g - r).abs().max() / r.abs().max()) for g, r in grads],
    }


def test_one_rank_matches_hf(moe_dir):
    r = _spawn(_matches_hf, 1, moe_dir)[0]
    assert r["logits"] <= 1e-5, r
    assert max(r["grads"]) <= 1e-4, r
