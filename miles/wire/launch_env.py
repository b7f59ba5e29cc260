"""Where this process sits in a torchrun or Slurm job, and the controller address every node agrees on.

Environment read (first match wins):
- node rank:   GROUP_RANK (torchrun), RANK // LOCAL_WORLD_SIZE, SLURM_NODEID / SLURM_PROCID, else 0
- node count:  GROUP_WORLD_SIZE, WORLD_SIZE // LOCAL_WORLD_SIZE, SLURM_NNODES, else 1
- controller:  MASTER_ADDR (else the first host of SLURM_JOB_NODELIST, else 127.0.0.1)
- port:        `--controller-port` in the `miles train` args (every node reads the same args, so the
               other nodes know where node 0 listens), else MILES_CONTROLLER_PORT, else MASTER_PORT + 1
               (MASTER_PORT defaults to 29500), so it never collides with torchrun's own store on
               MASTER_PORT; the trainers' rendezvous takes the port after it
- bind host:   `--controller-host` (node 0 only), else MILES_CONTROLLER_HOST, default 0.0.0.0 on several nodes
- run secret:  MILES_RUN_SECRET (any string, same on all nodes; the HMAC key is derived from it); else
               MILES_RUN_SECRET_FILE; else under torchrun node 0 generates one and hands it to the other
               nodes through torchrun's TCP store; under Slurm without either, launch refuses to start.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import re
import secrets
from typing import Any

from miles.wire import codec

_STORE_KEY = "miles/run_secret"


@dataclasses.dataclass(slots=True)
class LaunchEnv:
    node_rank: int
    num_nodes: int
    master_addr: str
    controller_port: int
    local_world_size: int
    local_rank: int = 0
    source: str = "single"  # "torchrun" | "slurm" | "single"
    bind_host: str | None = None  # where node 0's controller listens; None: 0.0.0.0


def first_slurm_host(nodelist: str) -> str:
    """First hostname of a Slurm nodelist such as ``gpu[003-005,9],cpu1`` -> ``gpu003``."""
    m = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
    if not m:
        raise ValueError(f"cannot parse SLURM_JOB_NODELIST={nodelist!r}")
    prefix, _, ranges = m.groups()
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def launch_env(environ: dict[str, str] | None = None) -> LaunchEnv:
    """Where this process sits in the job, from torchrun's or Slurm's environment."""
    env = os.environ if environ is None else environ
    return dataclasses.replace(_job_position(env), bind_host=env.get("MILES_CONTROLLER_HOST") or None)


def with_controller_flags(le: LaunchEnv, host: str | None, port: int) -> LaunchEnv:
    """`--controller-host` / `--controller-port` (0: unset) over the environment's controller address."""
    return dataclasses.replace(le, bind_host=host or le.bind_host, controller_port=port or le.controller_port)


def _job_position(env: Any) -> LaunchEnv:
    master_port = int(env.get("MASTER_PORT", "29500"))
    port = int(env.get("MILES_CONTROLLER_PORT", master_port + 1))
    if "GROUP_RANK" in env or "LOCAL_WORLD_SIZE" in env:
        local_ws = int(env.get("LOCAL_WORLD_SIZE", "1"))
        node_rank = int(env.get("GROUP_RANK", int(env.get("RANK", "0")) // local_ws))
        num_nodes = int(env.get("GROUP_WORLD_SIZE", int(env.get("WORLD_SIZE", "1")) // local_ws))
        return LaunchEnv(
            node_rank,
            num_nodes,
            env.get("MASTER_ADDR", "127.0.0.1"),
            port,
            local_ws,
            int(env.get("LOCAL_RANK", "0")),
            "torchrun",
        )
    if "SLURM_PROCID" in env:
        num_nodes = int(env.get("SLURM_NNODES", "1"))
        node_rank = int(env.get("SLURM_NODEID", env["SLURM_PROCID"]))
        master = env.get("MASTER_ADDR") or first_slurm_host(env.get("SLURM_JOB_NODELIST", "127.0.0.1"))
        return LaunchEnv(
            node_rank,
            num_nodes,
            master,
            port,
            int(env.get("SLURM_NTASKS_PER_NODE", "1")),
            int(env.get("SLURM_LOCALID", "0")),
            "slurm",
        )
    return LaunchEnv(0, 1, env.get("MASTER_ADDR", "127.0.0.1"), port, 1)


def resolve_run_secret(le: LaunchEnv) -> str:
    """The run secret shared by every node (see the module docstring for the order)."""
    if os.environ.get("MILES_RUN_SECRET"):
        return os.environ["MILES_RUN_SECRET"]
    if os.environ.get("MILES_RUN_SECRET_FILE"):
        with open(os.environ["MILES_RUN_SECRET_FILE"]) as f:
            return f.read().strip()
    if le.num_nodes == 1:
        return secrets.token_hex(32)
    if le.source == "torchrun":
        from torch.distributed import TCPStore

        store = TCPStore(
            le.master_addr,
            int(os.environ.get("MASTER_PORT", "29500")),
            is_master=False,
            timeout=datetime.timedelta(seconds=300),
        )
        if le.node_rank == 0:
            store.set(_STORE_KEY, secrets.token_hex(32))
        return store.get(_STORE_KEY).decode()
    raise RuntimeError(
        f"{le.num_nodes} nodes under {le.source} need a shared run secret: set MILES_RUN_SECRET "
        "(e.g. `export MILES_RUN_SECRET=$(openssl rand -hex 32)` in the sbatch script) or "
        "MILES_RUN_SECRET_FILE on every node"
    )


def runtime_options(le: LaunchEnv | None = None) -> dict[str, Any]:
    """Keyword arguments for ``Runtime.start`` matching this launch (IPC on one node, signed TCP on several)."""
    le = le or launch_env()
    if le.num_nodes == 1:
        return {"transport": "ipc", "num_nodes": 1}
    return {
        "transport": "tcp",
        "num_nodes": le.num_nodes,
        "host": le.bind_host or "0.0.0.0",
        "port": le.controller_port,
        "advertise_host": le.master_addr,
        "secret": codec.derive_key(resolve_run_secret(le)),
    }


def heartbeat_settings() -> dict[str, float]:
    """Heartbeat interval and timeout from MILES_HEARTBEAT_INTERVAL_S / MILES_HEARTBEAT_TIMEOUT_S: the
    launch self-test's. In a `miles train` run every node takes them from its `--heartbeat-*` flags."""
    return {
        "heartbeat_interval_s": float(os.environ.get("MILES_HEARTBEAT_INTERVAL_S", "1.0")),
        "heartbeat_timeout_s": float(os.environ.get("MILES_HEARTBEAT_TIMEOUT_S", "30.0")),
    }
