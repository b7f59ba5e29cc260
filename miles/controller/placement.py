"""Placement plan: which process plays which role on which node and device."""

from __future__ import annotations

import socket
from dataclasses import asdict, dataclass, fields, is_dataclass

from miles.controller.runtime import WorkerSpec


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass(slots=True)
class Placement:
    trainer_specs: list[WorkerSpec]
    rollout_specs: list[WorkerSpec]
    device: str
    colocated: bool

    @property
    def specs(self) -> list[WorkerSpec]:
        return self.trainer_specs + self.rollout_specs


def sections_dict(cfg) -> dict[str, dict]:
    """Every config section as a plain dict (msgpack-able), keyed by section name."""
    return {f.name: asdict(getattr(cfg, f.name)) for f in fields(cfg) if is_dataclass(getattr(cfg, f.name))}


def _kv_tokens(cfg) -> int:
    """Default KV capacity: every running request can hold a full prompt + response."""
    r = cfg.rollout
    per_request = r.rollout_max_context_len or ((cfg.data.rollout_max_prompt_len or 1024) + r.rollout_max_response_len)
    return cfg.engine.max_running_requests * per_request


def plan_placement(cfg, *, device: str, num_nodes: int = 1, master_addr: str = "127.0.0.1",
                   master_port: int | None = None, gpus_per_node: int | None = None) -> Placement:
    """Trainer ranks first, then engines; on GPU, colocated engines share the trainers' devices."""
    train, engine = cfg.train, cfg.engine
    dp = train.actor_num_nodes * train.actor_num_gpus_per_node
    per_node = gpus_per_node or train.actor_num_gpus_per_node
    master_port = master_port or free_port()
    sections = sections_dict(cfg)
    trainers = []
    for rank in range(dp):
        node = rank // train.actor_num_gpus_per_node
        local = rank % train.actor_num_gpus_per_node
        env = {"MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port), "RANK": str(rank),
               "WORLD_SIZE": str(dp), "LOCAL_RANK": str(local), "LOCAL_WORLD_SIZE": str(train.actor_num_gpus_per_node),
               # under torchrun the launcher's env says "join torchrun's store"; our trainers rendezvous on their own
               "TORCHELASTIC_USE_AGENT_STORE": "False"}
        if device == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = str(local)
            env["LOCAL_RANK"] = "0"
        trainers.append(WorkerSpec(role="trainer", rank=rank, entry="miles.workers.trainer_worker:TrainerWorker",
                                   node=node, env=env, init_kwargs={"sections": sections, "device": device}))
    rollouts = []
    gpus_per_engine = engine.rollout_num_gpus_per_engine
    for i in range(engine.rollout_num_engines):
        env: dict[str, str] = {}
        if device == "cuda":
            first = i * gpus_per_engine if engine.colocate else dp + i * gpus_per_engine
            node, local = divmod(first, per_node)
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(local + k) for k in range(gpus_per_engine))
        else:  # CPU: engines go after the trainer ranks' nodes, round-robin over the nodes
            node = (dp // max(1, train.actor_num_gpus_per_node) + i) % max(1, num_nodes) if num_nodes > 1 else 0
        rollouts.append(WorkerSpec(
            role="rollout", rank=i, entry="miles.workers.rollout_worker:RolloutWorker", node=node, env=env,
            init_kwargs={"engine": engine.engine, "model_path": cfg.model.hf_checkpoint, "device": device,
                         "dtype": cfg.model.dtype, "max_running_requests": engine.max_running_requests,
                         "max_total_tokens": engine.max_total_tokens or _kv_tokens(cfg), "seed": cfg.data.rollout_seed + i,
                         "deterministic": engine.deterministic, "sglang_args": engine.sglang_args,
                         "tp_size": gpus_per_engine}))
    if num_nodes > 1:
        for spec in trainers + rollouts:
            spec.env["MILES_NUM_NODES"] = str(num_nodes)
    return Placement(trainers, rollouts, device, engine.colocate)
