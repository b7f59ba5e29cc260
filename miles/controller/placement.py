"""Placement plan: which process plays which role on which node and which GPUs.

GPU plan (device "cuda"), on `num_nodes` nodes of `gpus_per_node` GPUs each:
- trainer rank r runs on node r // actor_num_gpus_per_node, local GPU r % actor_num_gpus_per_node;
- separate (not colocated) rollout engines take the GPUs the trainers leave free, node by node; an
  engine of k = rollout_num_gpus_per_engine GPUs takes k consecutive free GPUs of one node and
  never spans nodes;
- colocated engines share the trainers' GPUs: engine i runs on trainer GPUs i*k .. i*k+k-1;
- dedicated eval engines (fully async, --eval-num-engines) take free GPUs after the rollout engines;
- the OPD teacher engine (--opd-teacher-load) takes one free GPU after those, or, when none is left,
  shares rollout engine 0's (an embedded engine holds its weights and a KV cache of --max-total-tokens).
A layout the cluster cannot hold raises `PlacementError` before anything starts.
The debug modes plan the full layout, then start one side: `--debug-rollout-only` no trainers,
`--debug-train-only` no engines.

CPU plan (device "cpu"): trainer ranks are processes on the same nodes as above; engines go to
node 0, or round-robin over the nodes after the trainers' when there are several.
"""

from __future__ import annotations

import copy
import os
from dataclasses import asdict, dataclass, field, fields, is_dataclass

from miles.config import EMBEDDED_MAX_RUNNING_REQUESTS, EngineConfig, MilesConfig, engine_dtype, is_sft
from miles.true_on_policy import CUBLAS_WORKSPACE_CONFIG
from miles.utils.cublaslt import workspace_env
from miles.wire.ports import free_port
from miles.wire.specs import WorkerSpec

EVAL_ROLE = "eval_rollout"
EVAL_SEED_OFFSET = 10_000  # eval engine i samples with rollout_seed + 10000 + i
TEACHER_ROLE = "opd_teacher"  # the engine serving --opd-teacher-load
TEACHER_SEED_OFFSET = 20_000
ROLLOUT_ENTRY = "miles.workers.rollout_worker:RolloutWorker"
TRAINER_ENTRY = "miles.workers.trainer_worker:TrainerWorker"


class PlacementError(ValueError):
    """A layout the machine or cluster cannot hold, or node/GPU flags that contradict the launch.

    Raised before any process starts; `miles train` prints it as one line and exits 2.
    """


@dataclass(slots=True)
class Placement:
    trainer_specs: list[WorkerSpec]
    rollout_specs: list[WorkerSpec]
    device: str
    colocated: bool
    eval_specs: list[WorkerSpec] = field(default_factory=list)  # dedicated eval engines (role eval_rollout)
    num_nodes: int = 1
    gpus_per_node: int = 0  # 0 on CPU
    teacher_specs: list[WorkerSpec] = field(default_factory=list)  # the OPD teacher's engine (role opd_teacher)

    @property
    def specs(self) -> list[WorkerSpec]:
        return self.trainer_specs + self.rollout_specs + self.eval_specs + self.teacher_specs

    @property
    def gpus_needed(self) -> int:
        """Distinct GPUs the plan occupies (colocated engines share the trainers')."""
        return len({(s.node, g) for s in self.specs for g in spec_gpus(s)})

    def summary(self) -> dict:
        """The plan as plain data (what `miles train --dry-run` prints)."""
        return {
            "device": self.device,
            "num_nodes": self.num_nodes,
            "gpus_per_node": self.gpus_per_node,
            "gpus_needed": self.gpus_needed,
            "workers": [{"role": s.role, "rank": s.rank, "node": s.node, "gpus": spec_gpus(s)} for s in self.specs],
        }


def spec_gpus(spec: WorkerSpec) -> list[int]:
    """Local GPU indices a worker is given (its CUDA_VISIBLE_DEVICES); empty on CPU."""
    visible = spec.env.get("CUDA_VISIBLE_DEVICES", "")
    return [int(g) for g in visible.split(",") if g]


def sections_dict(cfg: MilesConfig) -> dict[str, dict]:
    """Every config section as a plain dict (msgpack-able), keyed by section name."""
    return {f.name: asdict(getattr(cfg, f.name)) for f in fields(cfg) if is_dataclass(getattr(cfg, f.name))}


def num_rollout_engines(cfg: MilesConfig) -> int:
    """Rollout engines to start: none for a trainer-only run (SFT, --debug-train-only), so none gets a GPU."""
    return 0 if is_sft(cfg) or cfg.runtime.debug_train_only else cfg.engine.rollout_num_engines


def num_eval_engines(cfg: MilesConfig) -> int:
    """Dedicated eval engines: only the fully async loop evaluates on them, and only beside a local fleet."""
    n = cfg.eval.eval_num_engines
    return n if n > 0 and cfg.async_.fully_async and num_rollout_engines(cfg) > 0 else 0


def engine_slots(cfg: MilesConfig, role: str) -> int:
    """Requests an embedded rollout engine runs at once: --max-running-requests, but no more than one step
    of the sync loop ever sends it (groups x samples over the engines), so the KV cache holds no slot that
    never fills. Eval requests beyond that wait their turn. Left as given with an explicit
    --max-total-tokens, in the fully async loop (more than a step in flight), and for eval / teacher engines."""
    engine, r = cfg.engine, cfg.rollout
    mrr = embedded_running_requests(engine)
    if role != "rollout" or engine.max_total_tokens or cfg.async_.fully_async or not r.rollout_batch_size:
        return mrr
    groups = r.over_sampling_batch_size or r.rollout_batch_size
    per_engine = -(-groups * r.n_samples_per_prompt // max(1, engine.rollout_num_engines))
    return max(1, min(mrr, per_engine))


def _kv_tokens(cfg: MilesConfig, slots: int) -> int:
    """Default KV capacity: each of `slots` requests can hold a full prompt + response (the run's
    --rollout-max-context-len, else prompt + response limits), never the model's own context length."""
    r = cfg.rollout
    per_request = r.rollout_max_context_len or ((cfg.data.rollout_max_prompt_len or 1024) + r.rollout_max_response_len)
    return slots * per_request


def embedded_running_requests(engine: EngineConfig) -> int:
    """The embedded engine's running batch: --max-running-requests, else its default."""
    return engine.max_running_requests or EMBEDDED_MAX_RUNNING_REQUESTS


def sglang_launch_args(engine: EngineConfig) -> dict:
    """The SGLang server arguments an engine gets: the `--sglang-*` passthrough and, with --engine sglang, the
    Miles flags SGLang reads under its own names. Unset Miles flags leave SGLang's own defaults; a flag given
    both ways is refused at start-up (`miles.config.rules.engines`). The embedded engine reads the passthrough only."""
    args = copy.deepcopy(engine.sglang_args)
    if engine.engine != "sglang":
        return args
    if engine.deterministic:
        args["enable_deterministic_inference"] = True
    if engine.max_running_requests is not None:
        args["max_running_requests"] = engine.max_running_requests
    if engine.max_total_tokens is not None:
        args["max_total_tokens"] = engine.max_total_tokens
    return args


class _FreeGpus:
    """The GPUs no trainer uses, handed out node by node; a request never spans two nodes."""

    def __init__(self, num_nodes: int, gpus_per_node: int, trainer_nodes: int, trainer_gpus_per_node: int) -> None:
        self.free = [
            list(range(trainer_gpus_per_node if n < trainer_nodes else 0, gpus_per_node)) for n in range(num_nodes)
        ]
        self.node = 0

    def take(self, k: int) -> tuple[int, list[int]] | None:
        while self.node < len(self.free) and len(self.free[self.node]) < k:
            self.node += 1  # too few left here: the rest of this node stays free
        if self.node == len(self.free):
            return None
        taken, self.free[self.node] = self.free[self.node][:k], self.free[self.node][k:]
        return self.node, taken


def _gpu_layout(cfg: MilesConfig, num_nodes: int, gpus_per_node: int, n_eval: int) -> tuple[list, list, list, list]:
    """Trainers' (node, gpu), rollout engines' (node, gpus), eval engines' (node, gpus), the teacher's (node, gpus)."""
    t, e = cfg.train, cfg.engine
    a, k, g = t.actor_num_gpus_per_node, e.rollout_num_gpus_per_engine, gpus_per_node
    dp, n_rollout = t.actor_num_nodes * a, num_rollout_engines(cfg)
    if a > g:
        raise PlacementError(
            f"--actor-num-gpus-per-node={a} but a node has {g} GPUs; set it to at most {g} "
            "and raise --actor-num-nodes instead"
        )
    if k > g and n_rollout + n_eval > 0:
        raise PlacementError(
            f"--rollout-num-gpus-per-engine={k} but a node has {g} GPUs and an engine never "
            f"spans nodes; set it to at most {g}"
        )
    need = dp + (0 if e.colocate else n_rollout * k) + n_eval * k
    if need > num_nodes * g:
        parts = [f"{dp} for trainers"]
        if not e.colocate:
            parts.append(f"{n_rollout} rollout engine(s) x {k}")
        if n_eval:
            parts.append(f"{n_eval} eval engine(s) x {k}")
        raise PlacementError(
            f"placement needs {need} GPUs ({' + '.join(parts)}) but the cluster has {num_nodes * g} "
            f"({num_nodes} node(s) x {g} GPUs); lower --actor-num-nodes, --actor-num-gpus-per-node, "
            "--rollout-num-engines or --eval-num-engines, use --colocate, or run on more nodes"
        )
    trainers = [(r // a, r % a) for r in range(dp)]
    pool = _FreeGpus(num_nodes, g, t.actor_num_nodes, a)
    engines = _colocated_engines(trainers, n_rollout, k, a) if e.colocate else _take_all(pool, n_rollout, k, "rollout")
    evals = _take_all(pool, n_eval, k, "eval")
    teacher = []
    if serves_teacher(cfg):
        got = pool.take(1)
        if got is None:  # no GPU left: share rollout engine 0's (or, with external engines only, trainer 0's)
            got = engines[0] if engines else (trainers[0][0], [trainers[0][1]])
        teacher = [got]
    return trainers, engines, evals, teacher


def serves_teacher(cfg: MilesConfig) -> bool:
    """This run starts an engine for the OPD teacher checkpoint (--opd-teacher-load)."""
    return bool(cfg.algo.use_opd and cfg.algo.opd_teacher_load) and not cfg.runtime.debug_train_only


def _colocated_engines(trainers: list[tuple[int, int]], n: int, k: int, a: int) -> list[tuple[int, list[int]]]:
    if n * k > len(trainers):
        raise PlacementError(
            f"--colocate: {n} engine(s) x {k} GPUs = {n * k} but the trainers hold {len(trainers)} "
            f"GPUs; set --rollout-num-engines to at most {len(trainers) // k}"
        )
    engines = []
    for i in range(n):
        share = trainers[i * k : (i + 1) * k]
        nodes = sorted({node for node, _ in share})
        if len(nodes) > 1:
            raise PlacementError(
                f"--colocate: engine {i} would span nodes {nodes} (trainer GPUs {i * k}..{i * k + k - 1} "
                f"with --actor-num-gpus-per-node={a}); pick a --rollout-num-gpus-per-engine "
                f"that divides {a}"
            )
        engines.append((nodes[0], [gpu for _, gpu in share]))
    return engines


def _take_all(pool: _FreeGpus, n: int, k: int, what: str) -> list[tuple[int, list[int]]]:
    taken = []
    for i in range(n):
        got = pool.take(k)
        if got is None:
            left = [len(f) for f in pool.free]
            raise PlacementError(
                f"{what} engine {i} needs {k} GPUs on one node but the free GPUs per node are {left} (an engine "
                "never spans nodes); pick a --rollout-num-gpus-per-engine that divides the GPUs a node has left "
                "after its trainers, or change --actor-num-gpus-per-node"
            )
        taken.append(got)
    return taken


def _trainer_spec(
    cfg, rank: int, node: int, local: int, device: str, master_addr: str, master_port: int, sections: dict
) -> WorkerSpec:
    t = cfg.train
    env = {
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "RANK": str(rank),
        "WORLD_SIZE": str(cfg.trainer_world_size),
        "LOCAL_RANK": str(local),
        "LOCAL_WORLD_SIZE": str(t.actor_num_gpus_per_node),
        # under torchrun the launcher's env says "join torchrun's store"; our trainers rendezvous on their own
        "TORCHELASTIC_USE_AGENT_STORE": "False",
    }
    if device == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = str(local)
        env["LOCAL_RANK"] = "0"
    env.update(_cublaslt_env(device))  # the engines' size: a true-on-policy forward computes alike on both sides
    if t.true_on_policy_mode:
        env.update(true_on_policy_env(device))
    return WorkerSpec(
        role="trainer",
        rank=rank,
        entry=TRAINER_ENTRY,
        node=node,
        env=env,
        init_kwargs={"sections": sections, "device": device},
    )


def _engine_spec(
    cfg: MilesConfig,
    role: str,
    rank: int,
    node: int,
    gpus: list[int],
    device: str,
    seed: int,
    model_path: str | None = None,
) -> WorkerSpec:
    engine = cfg.engine
    env = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus)), **_cublaslt_env(device)} if device == "cuda" else {}
    true_on_policy = cfg.train.true_on_policy_mode and role == "rollout"
    dtype = engine_dtype(cfg.model.dtype, engine.sglang_args)
    if true_on_policy:
        env.update(true_on_policy_env(device))
        dtype = true_on_policy_dtype(dtype, device)
    return WorkerSpec(
        role=role,
        rank=rank,
        entry=ROLLOUT_ENTRY,
        node=node,
        env=env,
        init_kwargs={
            "engine": engine.engine,
            "model_path": model_path or cfg.model.hf_checkpoint,
            "device": device,
            "dtype": dtype,
            "max_running_requests": engine_slots(cfg, role),
            "max_total_tokens": engine.max_total_tokens or _kv_tokens(cfg, engine_slots(cfg, role)),
            "seed": seed,
            "deterministic": engine.deterministic,
            "sglang_args": _with_routed_experts(
                sglang_launch_args(engine), cfg.train.use_rollout_routing_replay and engine.engine == "sglang"
            ),
            "tp_size": engine.rollout_num_gpus_per_engine,
            "api_key": engine.api_key,
            "weight_dirs": engine_weight_dirs(cfg),
            "max_body_mb": engine.http_max_body_mb,
            "true_on_policy": true_on_policy,
        },
    )


def _cublaslt_env(device: str) -> dict[str, str]:
    """cuBLASLt's workspace for a worker (miles/utils/cublaslt.py); a bad value is refused before any worker starts."""
    try:
        return workspace_env(device)
    except ValueError as e:
        raise PlacementError(str(e)) from None


def true_on_policy_env(device: str) -> dict[str, str]:
    """What both sides of --true-on-policy-mode need in their environment before CUDA starts."""
    return {"CUBLAS_WORKSPACE_CONFIG": CUBLAS_WORKSPACE_CONFIG} if device == "cuda" else {}


def true_on_policy_dtype(dtype: str, device: str) -> str:
    """The engine computes in the trainer's compute dtype (`--dtype auto`: bf16 on GPU, fp32 on CPU, as
    the trainer resolves it), never the checkpoint's own (an fp16 checkpoint would differ)."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if device == "cuda" else "float32"


def engine_weight_dirs(cfg: MilesConfig) -> list[str]:
    """The directories an engine's weight endpoints may use: the run's directory (eval snapshots) and
    --update-weight-disk-dir (disk-delta copies); the served model is readable besides."""
    dirs = [cfg.runtime.output_dir, cfg.weights.update_weight_disk_dir]
    return [os.path.abspath(d) for d in dirs if d]


def plan_placement(
    cfg: MilesConfig,
    *,
    device: str,
    num_nodes: int = 1,
    gpus_per_node: int | None = None,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
) -> Placement:
    """Trainers, rollout engines and dedicated eval engines on `num_nodes` nodes (see the module docstring).

    On "cuda", `gpus_per_node` is required; a layout that does not fit raises PlacementError.
    """
    t = cfg.train
    if t.actor_num_nodes > num_nodes:
        raise PlacementError(
            f"--actor-num-nodes={t.actor_num_nodes} but the job has {num_nodes} node(s); launch "
            f"on {t.actor_num_nodes} nodes or lower --actor-num-nodes"
        )
    n_rollout, n_eval = num_rollout_engines(cfg), num_eval_engines(cfg)
    if device == "cuda":
        if not gpus_per_node:
            raise PlacementError("a GPU plan needs the GPUs per node: give --num-gpus-per-node")
        trainer_gpus, rollout_gpus, eval_gpus, teacher_gpus = _gpu_layout(cfg, num_nodes, gpus_per_node, n_eval)
    else:  # CPU: engines go after the trainer ranks' nodes, round-robin over the nodes
        a = t.actor_num_gpus_per_node
        trainer_gpus = [(r // a, r % a) for r in range(cfg.trainer_world_size)]
        rollout_gpus = [((t.actor_num_nodes + i) % num_nodes if num_nodes > 1 else 0, []) for i in range(n_rollout)]
        eval_gpus = [(rollout_gpus[0][0], []) for _ in range(n_eval)]  # n_eval > 0 only beside rollout engines
        teacher_gpus = [(rollout_gpus[0][0] if rollout_gpus else 0, [])] if serves_teacher(cfg) else []
        gpus_per_node = 0
    master_port = master_port or free_port()
    sections = sections_dict(cfg)
    trainers = [
        _trainer_spec(cfg, rank, node, local, device, master_addr, master_port, sections)
        for rank, (node, local) in enumerate(trainer_gpus)
    ]
    seed = cfg.data.rollout_seed
    rollouts = [
        _engine_spec(cfg, "rollout", i, node, gpus, device, seed + i) for i, (node, gpus) in enumerate(rollout_gpus)
    ]
    evals = [
        _engine_spec(cfg, EVAL_ROLE, i, node, gpus, device, seed + EVAL_SEED_OFFSET + i)
        for i, (node, gpus) in enumerate(eval_gpus)
    ]
    teachers = [
        _engine_spec(cfg, TEACHER_ROLE, 0, node, gpus, device, seed + TEACHER_SEED_OFFSET, cfg.algo.opd_teacher_load)
        for node, gpus in teacher_gpus
    ]
    if cfg.runtime.debug_rollout_only:  # engines only
        trainers = []
    placement = Placement(trainers, rollouts, device, cfg.engine.colocate, evals, num_nodes, gpus_per_node, teachers)
    if num_nodes > 1:
        for spec in placement.specs:
            spec.env["MILES_NUM_NODES"] = str(num_nodes)
    return placement


def _with_routed_experts(sglang_args: dict, r3: bool) -> dict:
    """A copy of `sglang_args`; for SGLang engines under R3, with the server flag that lets /generate return
    routed experts (the embedded engine always can)."""
    args = copy.deepcopy(sglang_args)
    if r3:
        args.setdefault("enable_return_routed_experts", True)
    return args
