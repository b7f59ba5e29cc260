"""The machine a run is planned for: device kind, node count and GPUs per node, and the plan for it.

- nodes: `--num-nodes`, else the launch environment (torchrun / Slurm via `miles.wire.launch_env.launch_env`),
  else 1. A real run refuses a `--num-nodes` that differs from the launch: a flag accepted and
  ignored would plan for nodes nobody started.
- GPUs per node: `--num-gpus-per-node`, else detected (`detect_gpus_per_node`).
- device: "cuda" when this process sees CUDA devices; else "cpu" (a CPU plan, processes only),
  except that `miles train --dry-run --num-gpus-per-node G` plans a GPU layout on any machine.
"""

from __future__ import annotations

import ast
import importlib.util
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from miles.controller.placement import Placement, PlacementError, plan_placement

if TYPE_CHECKING:
    from miles.config import MilesConfig, RuntimeConfig
    from miles.wire.launch_env import LaunchEnv


@dataclass(slots=True)
class Machine:
    """What the plan is made for: the device kind, the nodes and the GPUs of each (0 on CPU)."""

    device: str  # "cuda" | "cpu"
    num_nodes: int
    gpus_per_node: int


def detect_gpus_per_node(environ: Mapping[str, str], cuda_count: int | None) -> int | None:
    """GPUs of one node: the CUDA device count, else SLURM_GPUS_ON_NODE, else torchrun's LOCAL_WORLD_SIZE."""
    if cuda_count:
        return cuda_count
    for name in ("SLURM_GPUS_ON_NODE", "LOCAL_WORLD_SIZE"):
        value = environ.get(name, "").strip()
        if value.isdigit() and int(value) > 0:
            return int(value)
    return None


def cuda_device_count() -> int:
    """CUDA devices this process may use: NVML's count (nvidia-ml-py, no torch import: seconds saved
    at start-up) within CUDA_VISIBLE_DEVICES; torch's count when NVML is not there."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            count = pynvml.nvmlDeviceGetCount()
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no NVML library or driver: ask torch
        if not torch_has_gpu_build():  # a CPU-only wheel: no devices, without importing torch (seconds)
            return 0
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    return visible_count(os.environ.get("CUDA_VISIBLE_DEVICES"), count)


def torch_has_gpu_build() -> bool:
    """Whether the installed torch was built for CUDA or ROCm, read from its `version.py` (no import).
    Unreadable or unusual: True, so that torch itself is asked."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return False  # no torch at all: no device it could use
    try:
        tree = ast.parse(Path(spec.submodule_search_locations[0], "version.py").read_text())
    except (OSError, SyntaxError, ValueError):
        return True
    values = {}
    for node in tree.body:
        target = node.target if isinstance(node, ast.AnnAssign) else None
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
        if isinstance(target, ast.Name) and isinstance(node.value, ast.Constant):
            values[target.id] = node.value.value
    if "cuda" not in values or "hip" not in values:
        return True
    return values["cuda"] is not None or values["hip"] is not None


def visible_count(visible: str | None, count: int) -> int:
    """Devices left by CUDA_VISIBLE_DEVICES (as CUDA reads it: up to the first invalid entry) of `count`."""
    if visible is None:
        return count
    entries = []
    for entry in visible.split(","):
        entry = entry.strip()
        if not entry or entry.startswith("-"):
            break
        entries.append(entry)
    return min(len(entries), count)


def resolve_machine(
    runtime: RuntimeConfig,
    launch: LaunchEnv,
    *,
    dry_run: bool = False,
    environ: Mapping[str, str] | None = None,
    cuda_count: int | None = None,
) -> Machine:
    """The machine a run is planned for, from --num-nodes / --num-gpus-per-node, the launch and CUDA.

    A real run refuses --num-nodes that differs from the launch environment and --num-gpus-per-node
    beyond the CUDA devices it sees; a dry run plans for whatever the flags say (a GPU layout on a
    CPU machine when --num-gpus-per-node is given). `cuda_count` None probes torch.
    """
    environ = os.environ if environ is None else environ
    num_nodes, gpus_flag = runtime.num_nodes, runtime.num_gpus_per_node
    if num_nodes is not None and num_nodes < 1:
        raise PlacementError(f"--num-nodes={num_nodes}; give at least 1 (or leave it out: taken from the launch)")
    if gpus_flag is not None and gpus_flag < 1:
        raise PlacementError(f"--num-gpus-per-node={gpus_flag}; give at least 1 (or leave it out: detected)")
    if num_nodes is None:
        num_nodes = launch.num_nodes
    elif num_nodes != launch.num_nodes and not dry_run:
        raise PlacementError(
            f"--num-nodes={num_nodes} but the launch environment ({launch.source}) has {launch.num_nodes} node(s); "
            "start one `python -m miles.launch` per node under torchrun or Slurm, or leave --num-nodes out"
        )
    if dry_run and gpus_flag is not None:
        return Machine("cuda", num_nodes, gpus_flag)
    if cuda_count is None:
        cuda_count = cuda_device_count()
    if cuda_count == 0:
        if gpus_flag is not None:
            raise PlacementError(
                f"--num-gpus-per-node={gpus_flag} but CUDA is not available on this machine; leave it out "
                "for a CPU run, or add --dry-run to plan a GPU layout"
            )
        return Machine("cpu", num_nodes, 0)
    if gpus_flag is not None and gpus_flag > cuda_count:
        raise PlacementError(
            f"--num-gpus-per-node={gpus_flag} but this node shows {cuda_count} CUDA device(s); "
            f"set it to at most {cuda_count}, or leave it out to use every device"
        )
    return Machine("cuda", num_nodes, gpus_flag or detect_gpus_per_node(environ, cuda_count))


def plan_run(cfg: MilesConfig, machine: Machine, launch: LaunchEnv) -> Placement:
    """The plan for `machine`; on several nodes the trainers rendezvous next to the controller's port."""
    multi_node = machine.num_nodes > 1
    return plan_placement(
        cfg,
        device=machine.device,
        num_nodes=machine.num_nodes,
        gpus_per_node=machine.gpus_per_node,
        master_addr=launch.master_addr if multi_node else "127.0.0.1",
        master_port=launch.controller_port + 1 if multi_node else None,
    )


def dry_run_report(cfg: MilesConfig, launch: LaunchEnv | None = None, *, cuda_count: int | None = None) -> dict:
    """`miles train --dry-run`: the resolved config and the placement plan, with nothing started."""
    if launch is None:
        from miles.wire.launch_env import launch_env, with_controller_flags

        launch = with_controller_flags(launch_env(), cfg.runtime.controller_host, cfg.runtime.controller_port)
    machine = resolve_machine(cfg.runtime, launch, dry_run=True, cuda_count=cuda_count)
    return {"config": cfg.to_dict(), "placement": plan_run(cfg, machine, launch).summary()}
