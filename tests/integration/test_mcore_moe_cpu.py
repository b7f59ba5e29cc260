"""megatron-core MoE (miles/trainer/mcore_moe.py) on a tiny random qwen3_moe, on CPU in fp32 over gloo.

- One rank: the megatron model's logits and gradients equal the HF model's on a packed row of sequences.
- R3: with a rollout routing given, the megatron routers use exactly those experts (routing mismatch 0,
  while the routers' own top-k differs), and the logits equal HF's under the FSDP replay of the same routing;
  the megatron backend's own `compute_log_probs` (its micro-batches and replay scope; megatron-core's schedule,
  which allocates on 'cuda', replaced by a host loop) replays and measures the same.
- Expert parallelism: EP=2, and expert-TP=2, over two gloo ranks (each its half of the sequences,
  data-parallel for the dense weights) give the log-probs of EP=1 on one rank, the same gradients after
  megatron-core's DDP reduction, and after one AdamW step the same weights, all exported to HF names by the
  backend's own gather (megatron_weights).

megatron-core's alltoall token dispatcher copies its split sizes to the host (as numpy) on a CUDA side stream;
on CPU `_cpu_shims` stands a host no-op in for that stream and makes the numpy conversion, which
megatron-core skips for tensors already on the host (gloo's all_to_all then refuses tensor split sizes). It also points
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
from _trainer_harness import start_ranks

from miles.wire.ports import free_port

if os.environ.get("MILES_MCORE_SITE"):  # CI: the py3.12 wheel's pure-Python modules, unpacked (.ci/run)
    sys.path.insert(0, os.environ["MILES_MCORE_SITE"])
if os.environ.get("MILES_REQUIRE_MCORE") == "1":
    import megatron.core  # noqa: F401  (CI installed it: a failure to import is a failure)
else:
    pytest.importorskip("megatron.core")

# two ranks take sequences {0, 1} and {2, 3}: 12 tokens each, as gloo's all_gather (which megatron-core's expert-TP
# token gather calls, NCCL allowing uneven sizes) needs equal sizes; the EP all-to-all splits stay uneven (routing)
LENS = (7, 5, 9, 3)
RESP = 4  # the last RESP tokens of each sequence are the response


class _HostStream:
    """What the dispatcher asks of its DtoH stream, on a host where every tensor already is on the host."""

    def wait_stream(self, _other) -> None: ...

    def record_event(self) -> _HostStream:
        return self

    def synchronize(self) -> None: ...


def _to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
    """megatron-core's maybe_move_tensor_to_cpu as on CUDA: split sizes become numpy (what all_to_all takes)."""
    return tensor.numpy() if torch.is_tensor(tensor) and as_numpy else tensor


def _cpu_shims() -> None:
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer.moe import token_dispatcher
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    token_dispatcher.maybe_move_tensor_to_cpu = _to_host
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
    start_ranks(_worker, (world, free_port(), fn, args, out), world)
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


def _build(path: str, ep: int, etp: int = 1):
    """(HF model, shape, megatron GPTModel holding this EP rank's experts) with expert parallel size `ep`."""
    from megatron.core import parallel_state
    from transformers import AutoModelForCausalLM

    from miles.trainer import mcore_convert as mc
    from miles.trainer import mcore_model as mm

    parallel_state.initialize_model_parallel(expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    s = mc.model_shape(hf.config)
    cfg = mm.transformer_config(
        s, tp=1, pp=1, cp=1, sequence_parallel=False, on_gpu=False, recompute=False, ep=ep, etp=etp
    )
    model = mm.build_gpt_model(s, cfg, num_stage_layers=s.num_layers, pre=True, post=True)
    hf_sd = {n: p.detach() for n, p in hf.named_parameters()}  # transformers' fused expert tensors
    ranks = dict(ep_rank=parallel_state.get_expert_model_parallel_rank(), ep_size=ep, etp_size=etp,
                 etp_rank=parallel_state.get_expert_tensor_parallel_rank())  # fmt: skip
    weights = mc.to_mcore(hf_sd, s, layers=range(s.num_layers), pre=True, post=True, **ranks)
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


def _bf16_router_backward(path: str) -> dict:
    """The router's gating and its backward under bf16 autocast, as `--dtype bfloat16` runs it."""
    _, s, model = _build(path, ep=1)
    router = model.decoder.layers[0].mlp.router
    x = torch.randn(5, s.hidden_size, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = router.gating(x)
    logits.pow(2).sum().backward()
    return {"logits_dtype": str(logits.dtype), "grads_finite": bool(torch.isfinite(router.weight.grad).all())}


def _one_rank(path: str) -> dict:
    from megatron.core import parallel_state

    hf = _matches_hf(path)
    parallel_state.destroy_model_parallel()
    bf16 = _bf16_router_backward(path)
    parallel_state.destroy_model_parallel()
    return {"hf": hf, "replay": _replays_a_given_routing(path), "bf16": bf16}


@pytest.fixture(scope="module")
def one_rank(moe_dir) -> dict:
    """Both one-rank checks in one spawned process (megatron-core's import is most of their time)."""
    return _spawn(_one_rank, 1, moe_dir)[0]


def test_one_rank_matches_hf(one_rank):
    r = one_rank["hf"]
    assert r["logits"] <= 1e-5, r
    assert max(r["grads"]) <= 1e-4, r


def test_bf16_autocast_backward_keeps_the_router_in_fp32(one_rank):
    """megatron-core's gating matmul would run in bf16 under autocast and its backward then fail on mixed dtypes."""
    assert one_rank["bf16"] == {"logits_dtype": "torch.float32", "grads_finite": True}


def _batch(ids: torch.Tensor, lens: list[int], routed: list[np.ndarray]):
    from miles.rollout.train_data import TrainBatch

    b = len(lens)
    return TrainBatch(
        tokens=ids.numpy(), seq_lens=np.array(lens), response_lengths=np.full(b, RESP),
        loss_masks=np.ones(b * RESP, np.float32), rewards=np.zeros(b, np.float32), raw_rewards=np.zeros(b, np.float32),
        group_index=np.arange(b), sample_index=np.arange(b), truncated=np.zeros(b, np.int8),
        routed_experts=np.concatenate(routed),
    )  # fmt: skip


def _replays_a_given_routing(path: str) -> dict:
    from miles.trainer.mcore_moe import McoreRoutingReplay
    from miles.trainer.routing_replay import RoutingReplay

    hf, s, model = _build(path, ep=1)
    ids, lens = _tokens(s.vocab_size), list(LENS)
    rng = np.random.default_rng(1)  # k distinct random experts per token and layer: the "rollout's" routing
    routed = [
        np.array([[rng.permutation(s.num_experts)[: s.moe_topk] for _ in range(s.num_layers)] for _ in range(n - 1)])
        for n in lens
    ]
    batch = _batch(ids, lens, [r.astype(np.uint8) for r in routed])
    everywhere = torch.arange(sum(lens))
    with torch.no_grad():
        plain = _forward(model, s, ids, lens, everywhere)
        replay = McoreRoutingReplay(model, mode="rollout")
        with replay.scope(batch, "row", first_pass=True):
            replayed = _forward(model, s, ids, lens, everywhere)
        hf_replay = RoutingReplay(hf, mode="rollout")  # the FSDP trainer's replay of the same routing
        padded = torch.zeros(len(lens), max(lens), dtype=torch.long)
        for i, (st, n) in enumerate(zip(np.cumsum([0, *lens[:-1]]), lens, strict=True)):
            padded[i, :n] = ids[st : st + n]
        with hf_replay.scope(batch, "padded", first_pass=True):
            hf_out = hf(input_ids=padded).logits
        ref = torch.cat([hf_out[i, :n] for i, n in enumerate(lens)])
    backend_lp, backend_counts = _backend_log_probs(path, model, s, batch)
    ends = np.cumsum(lens)
    predict = torch.from_numpy(np.concatenate([np.arange(e - RESP - 1, e - 1) for e in ends]))
    ref_lp = torch.log_softmax(ref[predict], -1).gather(1, ids[predict + 1][:, None])[:, 0].numpy()
    return {
        "backend_counts": backend_counts,
        "backend_vs_hf": float(np.abs(backend_lp - ref_lp).max()),
        "counts": replay.counts.tolist(),  # tokens compared, used routing != rollout, own top-k != rollout
        "hf_counts": hf_replay.counts.tolist(),
        "vs_hf": float((replayed - ref).abs().max() / ref.abs().max()),
        "replay_moves_logits": float((replayed - plain).abs().max() / ref.abs().max()),
    }


def test_rollout_routing_replay_uses_the_given_experts(one_rank):
    r = one_rank["replay"]
    tokens = sum(n - 1 for n in LENS)
    assert r["counts"][0] == tokens and r["counts"][1] == 0  # every routed token used exactly the rollout's experts
    assert r["counts"][2] > tokens // 2  # while the router's own top-k differs for most (random routing)
    assert r["counts"] == r["hf_counts"]  # the FSDP replay of the same routing measures the same
    assert r["vs_hf"] <= 1e-5 and r["replay_moves_logits"] > 1e-2, r
    # the megatron backend's own log-prob pass (micro-batches of 2, packed rows) replays and measures the same
    assert r["backend_counts"] == r["counts"] and r["backend_vs_hf"] <= 1e-4, r


def _host_schedule():
    """megatron-core's no-pipelining schedule, forward only, on the host (its own allocates on 'cuda')."""

    def run(*, forward_step_func, data_iterator, model, num_microbatches, forward_only, **_) -> list[dict]:
        assert forward_only
        outs = []
        for _ in range(num_microbatches):
            output, loss = forward_step_func(data_iterator, model[0])
            outs.append(loss(output)[2])  # (loss, token count, the dict the backend collects)
        return outs

    return run


def _backend_log_probs(path: str, model, s, batch) -> tuple[np.ndarray, list[float]]:
    """The megatron backend's `compute_log_probs` under R3 (its micro-batches, replay scope and log-prob
    assembly) on `model`, with the schedule on the host; (log-probs, the replay's counts)."""
    from miles.config import AlgoConfig, ModelConfig, RolloutConfig, TrainConfig
    from miles.trainer import megatron
    from miles.trainer.mcore_moe import McoreRoutingReplay

    megatron.get_forward_backward_func = _host_schedule
    train = TrainConfig(micro_batch_size=2, use_rollout_routing_replay=True, use_routing_replay=True)
    be = megatron.MegatronBackend(
        model=ModelConfig(hf_checkpoint=path), train=train, algo=AlgoConfig(), rollout=RolloutConfig()
    )
    be.actor, be.shape, be.device, be.compute_dtype = model, s, torch.device("cpu"), torch.float32
    be.tp_size, be.pp_size, be.is_last_stage = 1, 1, True
    be.replay = McoreRoutingReplay(model, mode="rollout")
    be.replay.begin_step()
    return be.compute_log_probs(batch)[0], be.replay.counts.tolist()


def _ep_step(path: str, ep: int, etp: int = 1) -> dict:
    """Log-probs of this rank's sequences and the HF weights after one optimizer step on the whole batch.

    Gradients go through megatron-core's DDP buffers and `finalize_model_grads` (the backend's reduction);
    the step is torch's AdamW on those reduced gradients, the optimizer megatron-core's FP32Optimizer wraps
    without Apex / TE: its own wrappers allocate on 'cuda' unconditionally and do not run on CPU.
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    from miles.trainer.megatron_weights import named_hf_tensors

    _, s, model = _build(path, ep=ep, etp=etp)
    ids, rank, world = _tokens(s.vocab_size), dist.get_rank(), dist.get_world_size()
    mine = list(range(len(LENS))) if world == 1 else [2 * rank, 2 * rank + 1]
    starts = np.concatenate([[0], np.cumsum(LENS)[:-1]])
    ids = torch.cat([ids[starts[i] : starts[i] + LENS[i]] for i in mine])
    lens = [LENS[i] for i in mine]
    ends = np.cumsum(lens)
    predict = torch.from_numpy(np.concatenate([np.arange(e - RESP - 1, e - 1) for e in ends]))
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=False)
    ddp = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)
    params = [p for p in ddp.module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
    logits = _forward(ddp, s, ids, lens, predict)
    lp = torch.log_softmax(logits, -1).gather(1, ids[predict + 1][:, None])[:, 0]
    (-lp.sum() / (RESP * len(LENS))).backward()  # per-token mean over the whole batch: summed over DP ranks
    finalize_model_grads([ddp], num_tokens=None)

    def export() -> dict[str, np.ndarray]:
        return {n: t.numpy().copy() for n, t in named_hf_tensors(ddp.module, s, torch.device("cpu"))}

    values = [p.data for p in params]
    for p in params:  # the reduced gradients, exported under the HF names as the weights are
        p.data, p.grad = p.main_grad, p.main_grad
    grads = export()
    for p, v in zip(params, values, strict=True):
        p.data = v
    opt.step()
    return {"log_probs": lp.detach().numpy(), "grads": grads, "weights": export()}


@pytest.fixture(scope="module")
def ep_one(moe_dir) -> dict:
    """The EP=1 reference step on one rank, which both layouts below compare with (a deterministic run:
    the same result each time it is made)."""
    return _spawn(_ep_step, 1, moe_dir, 1)[0]


@pytest.mark.parametrize(("ep", "etp"), [(2, 1), (1, 2)])
def test_two_expert_parallel_ranks_match_one(moe_dir, ep_one, ep, etp):
    from transformers import AutoModelForCausalLM

    one = ep_one
    two = _spawn(_ep_step, 2, moe_dir, ep, etp)
    lp_two = np.concatenate([two[0]["log_probs"], two[1]["log_probs"]])
    assert np.abs(lp_two - one["log_probs"]).max() <= 1e-5  # measured: 1.9e-6 (EP=2), 2.4e-6 (expert-TP=2)
    start = {n: p.detach().numpy() for n, p in AutoModelForCausalLM.from_pretrained(moe_dir).named_parameters()}
    moved = (
        one["weights"]["model.layers.1.mlp.experts.3.down_proj.weight"]
        - start["model.layers.1.mlp.experts.down_proj"][3]
    )
    assert np.abs(moved).max() > 5e-4  # the step moved the experts (Adam's first step: about lr per weight)
    for rank in range(2):
        assert sorted(two[rank]["weights"]) == sorted(one["weights"])
        grad_err = {n: float(np.abs(two[rank]["grads"][n] - g).max() / max(np.abs(g).max(), 1e-12))
                    for n, g in one["grads"].items()}  # fmt: skip
        step_err = {n: float(np.abs(two[rank]["weights"][n] - w).max()) for n, w in one["weights"].items()}
        assert max(grad_err.values()) <= 1e-5, (rank, grad_err)  # measured: 9.4e-7 (EP=2), 1.4e-6 (expert-TP=2)
        # Adam's first step is about lr * sign(g): where g is near 0, fp32 rounding of g moves the update by up
        # to ~lr, so the bound is 5% of lr (measured: 1.2e-6 here; 1.2e-5 on another batch)
        assert max(step_err.values()) <= 5e-5, (rank, step_err)


def test_checkpoint_experts_are_read_in_either_naming(moe_dir, tmp_path):
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from miles.trainer.megatron_weights import read_hf_tensors
    from miles.utils.moe_names import split_fused_experts

    fused = {n: p.detach().contiguous() for n, p in AutoModelForCausalLM.from_pretrained(moe_dir).named_parameters()}
    save_file(fused, str(tmp_path / "model.safetensors"))  # transformers-5 names on disk
    want = dict(split_fused_experts(fused.items()))
    names = {n for n in want if ".layers.1.mlp." in n}
    for path in (str(tmp_path), moe_dir):  # fused, then the per-expert checkpoint make_tiny_model wrote
        got = read_hf_tensors(path, names)
        assert sorted(got) == sorted(names) and all(torch.equal(got[n], want[n]) for n in names), path
    with pytest.raises(ValueError, match="lacks"):
        read_hf_tensors(str(tmp_path), {"model.layers.9.mlp.experts.0.up_proj.weight"})
