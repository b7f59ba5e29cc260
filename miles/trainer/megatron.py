"""megatron-core trainer backend (`--train-backend megatron`): tensor, pipeline and data parallelism.

The trainer world of `--actor-num-nodes x --actor-num-gpus-per-node` ranks is split by megatron-core's
`parallel_state` into TP x PP x DP (`--tensor-model-parallel-size`, `--pipeline-model-parallel-size`;
DP is what is left). The controller gives every rank of one data-parallel replica the same shard.
The model is megatron-core's GPTModel built from the HF config (`mcore_model`), its weights converted
from the HF checkpoint (`mcore_convert`; Qwen3-MoE with megatron-core's MoE layers, expert parallelism and
routing replay: `mcore_moe`), wrapped in megatron-core's DistributedDataParallel and
trained by its distributed optimizer (Adam states sharded over DP). Parameters stay fp32, the
checkpoint's values, and `--dtype` is the compute dtype (autocast), as in the FSDP backend: bf16
parameters would round every weight at load and hide updates smaller than half a bf16 step from
both the forward and the engines. Micro-batches are THD-packed rows (`megatron_microbatch.py`) run
through megatron-core's forward/backward schedule (1F1B across pipeline stages). Losses arrive divided by step-wide denominators
(`calculate_per_token_loss`), so gradients are summed over micro-batches and DP ranks, as in FSDP.

Weights leave as HF tensors (`named_hf_tensors`): tensor-parallel shards are gathered, and each
pipeline stage broadcasts its layers to the other stages, so every rank yields the same stream, as
the weight transports expect. Checkpoints keep the shared layout (`checkpoint.py`) with the model
directory written by megatron-core's `dist_checkpointing` (`megatron_checkpoint.py`). Offload and the
memory plan: `megatron_offload.py`. Needs CUDA and NCCL.
"""

from __future__ import annotations

import logging
import resource
import time
from collections.abc import Callable, Iterator

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func

from miles.config import AlgoConfig, ModelConfig, RolloutConfig, TrainConfig
from miles.rollout.train_data import TrainBatch
from miles.trainer import mcore_convert as mc
from miles.trainer.backend import MicroBatchLoss, register_backend
from miles.trainer.forward import log_probs_and_entropy, token_index
from miles.trainer.hf_io import resolve_compute_dtype, source_dtype, write_hf_dir
from miles.trainer.lr_schedule import LRSchedule, LRScheduler
from miles.trainer.mcore_model import build_gpt_model, response_logits, transformer_config
from miles.trainer.mcore_moe import McoreRoutingReplay
from miles.trainer.megatron_checkpoint import load_megatron_checkpoint, save_megatron_checkpoint
from miles.trainer.megatron_microbatch import MicroBatch, pack_thd
from miles.trainer.megatron_offload import offload_to_host, onload_actor, onloaded, plan_rank_memory
from miles.trainer.megatron_weights import named_hf_tensors, read_hf_tensors
from miles.trainer.moe_layout import check_moe_layout
from miles.trainer.offload import HostOffloader
from miles.trainer.packing import plan_micro_batches
from miles.trainer.routing_replay import replay_scope
from miles.trainer.train_loop import run_rl_step

logger = logging.getLogger(__name__)


def _finalize_grads(model: list[torch.nn.Module], num_tokens=None, **kw) -> None:
    """DP / sequence-parallel / tied-embedding gradient reductions, summing: the losses already carry
    the step's denominators, so the per-token division megatron-core would apply is skipped."""
    finalize_model_grads(model, num_tokens=None, **kw)


@register_backend("megatron")
class MegatronBackend:
    def __init__(self, *, model: ModelConfig, train: TrainConfig, algo: AlgoConfig, rollout: RolloutConfig) -> None:
        self.model_cfg, self.train_cfg, self.algo, self.rollout = model, train, algo, rollout
        self.weight_version = 0
        self.actor: DistributedDataParallel | None = None
        self.optimizer = None
        self.scheduler: LRScheduler | None = None
        self.ref: torch.nn.Module | None = None
        self.replay: McoreRoutingReplay | None = None
        self._offloaders: dict[str, HostOffloader] = {}

    # ---- setup ------------------------------------------------------------------------------------
    @property
    def has_ref(self) -> bool:
        return self.ref is not None

    @property
    def has_critic(self) -> bool:
        return False

    def setup(self) -> None:
        t = self.train_cfg
        if not (dist.is_initialized() and torch.cuda.is_available() and dist.get_backend() == "nccl"):
            raise RuntimeError("--train-backend megatron needs CUDA GPUs and an NCCL process group; use fsdp on CPU")
        tp, pp = t.tensor_model_parallel_size, t.pipeline_model_parallel_size
        ep, etp = t.expert_model_parallel_size, t.expert_tensor_parallel_size
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            context_parallel_size=t.context_parallel_size,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=etp,
        )
        tensor_parallel.model_parallel_cuda_manual_seed(t.seed)
        torch.manual_seed(t.seed)
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.dp_group = parallel_state.get_data_parallel_group()
        self.tp_size, self.pp_size = tp, pp
        self.pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        self.pp_group = parallel_state.get_pipeline_model_parallel_group()
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.is_last_stage = self.pp_rank == pp - 1
        from transformers import AutoConfig

        self.hf_config = AutoConfig.from_pretrained(
            self.model_cfg.hf_checkpoint, trust_remote_code=self.model_cfg.trust_remote_code
        )
        self.shape = mc.model_shape(self.hf_config)
        check_moe_layout(self.shape.num_experts, tp=tp, sequence_parallel=t.sequence_parallel, ep=ep, etp=etp)
        self.layers = mc.stage_layers(self.shape.num_layers, pp, self.pp_rank)
        self.compute_dtype = resolve_compute_dtype(self.model_cfg.dtype, "cuda")
        self.config = transformer_config(
            self.shape,
            tp=tp,
            pp=pp,
            cp=t.context_parallel_size,
            sequence_parallel=t.sequence_parallel,
            on_gpu=True,
            recompute=t.gradient_checkpointing,
            ep=ep,
            etp=etp,
        )
        self.actor, self.optimizer, self.scheduler = self._build_trainable(self.model_cfg.hf_checkpoint)
        if t.use_routing_replay:  # --use-(rollout-)routing-replay: the actor's routers replay (mcore_moe.py)
            mode = "rollout" if t.use_rollout_routing_replay else "self"
            self.replay = McoreRoutingReplay(self.actor.module, mode=mode)
        if self.algo.use_kl_loss or self.algo.kl_coef != 0.0:
            self.ref = self._build_model(self.model_cfg.ref_load or self.model_cfg.hf_checkpoint).eval()
            self.ref.requires_grad_(False)
        logger.info(
            "megatron backend ready: tp=%d pp=%d dp=%d ep=%d etp=%d sp=%s compute=%s layers %d-%d here, ref=%s",
            tp, pp, self.dp_size, ep, etp, t.sequence_parallel, self.compute_dtype,
            self.layers.start, self.layers.stop - 1, self.ref is not None,
        )  # fmt: skip

    def _build_model(self, path: str) -> torch.nn.Module:
        pre, post = self.pp_rank == 0, self.is_last_stage
        model = build_gpt_model(self.shape, self.config, num_stage_layers=len(self.layers), pre=pre, post=post)
        t, ps = self.train_cfg, parallel_state
        ranks = dict(
            tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=self.tp_size,
            ep_rank=ps.get_expert_model_parallel_rank(), ep_size=t.expert_model_parallel_size,
            etp_rank=ps.get_expert_tensor_parallel_rank(), etp_size=t.expert_tensor_parallel_size,
        )  # fmt: skip
        names = mc.stage_names(self.shape, self.layers, pre=pre, post=post, ep_rank=ranks["ep_rank"],
                               ep_size=ranks["ep_size"])  # fmt: skip
        hf = read_hf_tensors(path, {h for _, hnames in names for h in hnames})
        weights = mc.to_mcore(hf, self.shape, layers=self.layers, pre=pre, post=post, **ranks)
        missing, unexpected = model.load_state_dict(weights, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise RuntimeError(
                f"HF -> megatron conversion of {path}: missing {missing[:3]}, unexpected {unexpected[:3]}"
            )
        return model.to(self.device)

    def _build_trainable(self, path: str):
        t = self.train_cfg
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True)
        model = DistributedDataParallel(config=self.config, ddp_config=ddp_config, module=self._build_model(path))
        model.train()
        self.config.no_sync_func = model.no_sync
        self.config.finalize_model_grads_func = _finalize_grads
        opt_config = OptimizerConfig(
            optimizer="adam",
            lr=t.lr,
            min_lr=t.min_lr,
            weight_decay=t.weight_decay,
            adam_beta1=t.adam_beta1,
            adam_beta2=t.adam_beta2,
            adam_eps=t.adam_eps,
            clip_grad=t.clip_grad,
            params_dtype=torch.float32,
            use_distributed_optimizer=True,
        )
        optimizer = get_megatron_optimizer(opt_config, [model])
        schedule = LRSchedule(
            lr=t.lr, min_lr=t.min_lr, warmup_iters=t.lr_warmup_iters, decay_style=t.lr_decay_style,
            decay_iters=t.lr_decay_iters,
        )  # fmt: skip
        return model, optimizer, LRScheduler(optimizer, schedule)

    # ---- the schedule ---------------------------------------------------------------------------
    def _micro_batches(self, batch: TrainBatch) -> list[MicroBatch]:
        t = self.train_cfg
        plan = plan_micro_batches(
            batch.seq_lens,
            micro_batch_size=t.micro_batch_size,
            use_dynamic_batch_size=t.use_dynamic_batch_size,
            max_tokens_per_gpu=t.max_tokens_per_gpu,
        )
        multiple = self.tp_size if t.sequence_parallel else 1
        return [pack_thd(batch, idx, self.device, multiple) for idx in plan]

    def _run_schedule(
        self, model: torch.nn.Module, mbs: list[MicroBatch], loss: Callable, *, forward_only: bool, replay=None
    ) -> list[dict]:
        """megatron-core's forward(/backward) over `mbs`; the per-micro-batch dicts `loss` returned
        (on the last stage; [] elsewhere). `replay`: the routing replay of the actor's forward, in the step's
        first pass when `forward_only` (the old log-prob pass)."""
        vocab = self.shape.vocab_size

        autocast = self.compute_dtype != torch.float32

        def forward_step(data_iterator, chunk):
            mb = next(data_iterator)
            with (
                replay_scope(replay, mb.sub, "row", first_pass=forward_only),
                torch.autocast("cuda", dtype=self.compute_dtype, enabled=autocast),
            ):
                out = chunk(
                    mb.input_ids,
                    mb.position_ids,
                    None,
                    packed_seq_params=mb.seq_params,
                    output_processor=response_logits,
                    output_processor_context={"logits_index": mb.logits_index, "vocab_size": vocab},
                )
            return out, lambda logits: loss(mb, logits)

        return get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(mbs),
            model=[model],
            num_microbatches=len(mbs),
            seq_length=max(int(mb.input_ids.shape[1]) for mb in mbs),
            micro_batch_size=1,
            forward_only=forward_only,
        )

    def _from_last_stage(self, obj):
        """`obj` as the last pipeline stage has it, on every stage."""
        if self.pp_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(
            box, src=parallel_state.get_pipeline_model_parallel_last_rank(), group=self.pp_group
        )
        return box[0]

    # ---- forward-only -----------------------------------------------------------------------------
    def compute_log_probs(self, batch: TrainBatch, which: str = "actor") -> tuple[np.ndarray, np.ndarray]:
        model = {"actor": self.actor, "ref": self.ref}.get(which)
        if model is None:
            raise ValueError(
                f"compute_log_probs(which={which!r}): no such model here (actor, or ref when a KL term is on)"
            )
        temperature = self.rollout.rollout_temperature
        one = torch.ones((), dtype=torch.int, device=self.device)

        def loss(mb: MicroBatch, logits: torch.Tensor):
            lp, ent = log_probs_and_entropy(logits, mb.targets, temperature)
            return lp.sum() * 0.0, one, {"idx": mb.idx, "log_probs": lp.cpu().numpy(), "entropy": ent.cpu().numpy()}

        was_training = model.training
        model.eval()
        replay = self.replay if which == "actor" else None
        with torch.no_grad(), onloaded(self._offloaders, which, self.ref):
            outs = self._run_schedule(model, self._micro_batches(batch), loss, forward_only=True, replay=replay)
        if replay is not None:
            replay.end_pass(first_pass=True)
        model.train(was_training)
        n_tok = int(batch.response_lengths.sum())
        log_probs, entropy = np.zeros(n_tok, np.float32), np.zeros(n_tok, np.float32)
        for out in self._from_last_stage(outs if self.is_last_stage else None):
            pos = token_index(batch.response_lengths, out["idx"])
            log_probs[pos], entropy[pos] = out["log_probs"], out["entropy"]
        return log_probs, entropy

    def compute_values(self, batch: TrainBatch) -> np.ndarray:
        raise NotImplementedError("the megatron backend has no critic (PPO is refused at start-up)")

    # ---- training ---------------------------------------------------------------------------------
    def train(self, batch: TrainBatch, rollout_id: int) -> dict[str, float]:
        if self.replay is None:
            return run_rl_step(self, batch, rollout_id)
        self.replay.begin_step()
        metrics = run_rl_step(self, batch, rollout_id)
        return {**metrics, **self.replay.metrics(self.device, self.dp_group)}

    def forward_backward(
        self, step_batch: TrainBatch, loss_fn: MicroBatchLoss, *, critic: bool, entropy: str
    ) -> dict[str, torch.Tensor]:
        if critic:
            raise NotImplementedError("the megatron backend has no critic")
        temperature = self.rollout.rollout_temperature
        one = torch.ones((), dtype=torch.int, device=self.device)

        def loss(mb: MicroBatch, logits: torch.Tensor):
            lp, ent = log_probs_and_entropy(logits, mb.targets, temperature, entropy=entropy)
            value, parts = loss_fn(mb.idx, lp, ent)
            return value, one, {k: float(v.detach()) for k, v in parts.items()}

        mbs = self._micro_batches(step_batch)
        outs = self._run_schedule(self.actor, mbs, loss, forward_only=False, replay=self.replay)
        if self.replay is not None:
            self.replay.end_pass(first_pass=True)  # a fused old-log-prob step measured here
        sums: dict[str, float] = {}
        for parts in outs:
            for k, v in parts.items():
                sums[k] = sums.get(k, 0.0) + v
        sums = self._from_last_stage(sums if self.is_last_stage else None)
        return {k: torch.tensor(v, dtype=torch.float64, device=self.device) for k, v in sums.items()}

    def clip_grad_norm(self, *, critic: bool) -> float:
        """The global grad norm of the main (fp32) gradients; the clipping itself happens in
        `optimizer_step`, inside megatron-core's optimizer step (same `--clip-grad`)."""
        self.optimizer.prepare_grads()
        return float(self.optimizer.get_grad_norm())

    def optimizer_step(self, *, critic: bool) -> None:
        self.optimizer.step()
        self.zero_grad(critic=critic)
        self.scheduler.step()

    def zero_grad(self, *, critic: bool) -> None:
        self.actor.zero_grad_buffer()
        self.optimizer.zero_grad()

    def current_lr(self) -> float:
        return self.scheduler.current_lr

    # ---- weights out --------------------------------------------------------------------------------
    def named_hf_tensors(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Every HF tensor, full, the same stream on every rank (megatron_weights.named_hf_tensors)."""
        return named_hf_tensors(self.actor.module, self.shape, self.device, dtype)

    def export_hf(self, path: str) -> None:
        dtype = source_dtype(self.model_cfg.hf_checkpoint)
        tensors = [(n, t.cpu()) for n, t in self.named_hf_tensors(dtype)]
        if dist.get_rank() == 0:
            write_hf_dir(path, tensors, config=self.hf_config, source_dir=self.model_cfg.hf_checkpoint)
        dist.barrier()

    # ---- checkpoints ----------------------------------------------------------------------------------
    def save(self, path: str, extra_state: dict) -> None:
        meta = {
            "extra_state": extra_state,
            "weight_version": self.weight_version,
            "lr_schedule": self.scheduler.state_dict(),
        }
        save_megatron_checkpoint(path, self.actor, self.optimizer, meta, save_optim=not self.train_cfg.no_save_optim)

    def finish_saves(self) -> None:
        """Checkpoints are written synchronously here (--async-save is refused for megatron)."""

    def load(self, path: str) -> dict:
        meta = load_megatron_checkpoint(path, self.actor, self.optimizer)
        self.scheduler.load_state_dict(meta["lr_schedule"])
        return meta.get("extra_state", {})

    # ---- offload ------------------------------------------------------------------------------------
    def offload(self) -> None:
        """Weights, gradient buffers, fp32 master weights and Adam states to host; the reference model
        too, brought back from then on only for its own forward."""
        offload_to_host(self._offloaders, self.actor, self.optimizer, self.ref)

    def onload(self) -> None:
        onload_actor(self._offloaders)

    def memory_plan(self) -> dict:
        """Whether this rank trains without offloading beside its colocated engine (megatron_offload.py)."""
        return plan_rank_memory(self.actor, self.optimizer, self.hf_config, self.train_cfg, self.rollout, self.device)

    # ---- metrics helpers ---------------------------------------------------------------------------
    def peak_mem_gb(self) -> float:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2**30
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20

    @staticmethod
    def now() -> float:
        torch.cuda.synchronize()
        return time.perf_counter()
