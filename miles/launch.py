"""Multi-node entry: ``python -m miles.launch [--selftest --workers-per-node K] [-- <miles train args>]``.

Start one process per node with torchrun (``--nproc-per-node 1``) or srun (one task per node).
Node 0 becomes the controller (it runs ``miles train`` with the runtime set for ``num_nodes``);
every other node runs a node agent that spawns the workers the controller places there.

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

import argparse
import dataclasses
import datetime
import json
import logging
import os
import re
import secrets
import signal
import socket
import sys
import time
from typing import Any

from miles.controller import codec

logger = logging.getLogger(__name__)

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


def _heartbeat_settings() -> dict[str, float]:
    return {
        "heartbeat_interval_s": float(os.environ.get("MILES_HEARTBEAT_INTERVAL_S", "1.0")),
        "heartbeat_timeout_s": float(os.environ.get("MILES_HEARTBEAT_TIMEOUT_S", "30.0")),
    }


async def _selftest(le: LaunchEnv, workers_per_node: int, run_dir: str, options: dict[str, Any]) -> dict[str, Any]:
    from miles.controller.runtime import Runtime, WorkerSpec

    specs = [
        WorkerSpec("noop", node * workers_per_node + i, "miles.workers.noop:NoopWorker", node=node)
        for node in range(le.num_nodes)
        for i in range(workers_per_node)
    ]
    t0 = time.perf_counter()
    async with await Runtime.start(specs, run_dir=run_dir, **options, **_heartbeat_settings()) as rt:
        startup_s = time.perf_counter() - t0
        infos = await rt.call_all("noop", "whoami", timeout_s=60)
        echoed = await rt.call_all("noop", "echo", "ping", timeout_s=60)
    per_node: dict[int, list[int]] = {}
    for info in infos:
        per_node.setdefault(info["node"], []).append(info["pid"])
    return {
        "selftest": "ok" if all(e == "ping" for e in echoed) else "failed",
        "num_nodes": le.num_nodes,
        "workers": len(infos),
        "workers_per_node": {str(k): len(v) for k, v in sorted(per_node.items())},
        "startup_s": round(startup_s, 3),
        "transport": options["transport"],
    }


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    rest: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, rest = argv[:i], argv[i + 1 :]
    p = argparse.ArgumentParser(prog="python -m miles.launch", description=__doc__.splitlines()[0])
    p.add_argument("--selftest", action="store_true", help="spawn no-op workers on every node, call each, exit")
    p.add_argument("--workers-per-node", type=int, default=2)
    p.add_argument("--run-dir", default=os.environ.get("MILES_RUN_DIR", "runs/launch-selftest"))
    # torchrun swallows the `--` after `-m miles.launch`: flags this parser does not know go to `miles train`
    args, unknown = p.parse_known_args(argv)
    return args, unknown + rest


def main(argv: list[str] | None = None) -> int:
    args, rest = _parse(list(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(
        level=os.environ.get("MILES_LOG_LEVEL", "INFO"), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    le = _with_train_flags(launch_env(), rest)
    if le.local_rank != 0:
        logger.warning("local rank %d exits: start one launch process per node (--nproc-per-node 1)", le.local_rank)
        return 0
    logger.info(
        "launch on %s: node %d of %d, controller %s:%d",
        socket.gethostname(),
        le.node_rank,
        le.num_nodes,
        le.master_addr,
        le.controller_port,
    )
    if le.num_nodes > 1:  # resolve once: under torchrun node 0 publishes a fresh secret through the store
        os.environ["MILES_RUN_SECRET"] = resolve_run_secret(le)
    if le.node_rank != 0:
        from miles.workers.node_agent import run_agent

        signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # Slurm's pre-timeout signal: the controller acts on it

        key = codec.derive_key(os.environ["MILES_RUN_SECRET"])
        return run_agent(le.node_rank, f"tcp://{le.master_addr}:{le.controller_port}", key, **_heartbeat_settings())
    options = runtime_options(le)
    if args.selftest:
        from miles.controller.rpc import run_event_loop

        summary = run_event_loop(_selftest(le, args.workers_per_node, args.run_dir, options))
        print(json.dumps(summary), flush=True)
        return 0 if summary["selftest"] == "ok" else 1
    return _run_train(le, rest)


def _with_train_flags(le: LaunchEnv, train_args: list[str]) -> LaunchEnv:
    """The controller address node 0 will use: the `miles train` args every node was given decide it."""
    from miles.config import load_config
    from miles.config_fields import ConfigError

    try:
        runtime = load_config(train_args, for_train=False).runtime
    except (ConfigError, OSError) as e:
        if le.node_rank == 0:  # `miles train` on this node reports it in one line
            return le
        raise SystemExit(f"miles.launch node {le.node_rank}: cannot read the miles train args: {e}") from None
    return with_controller_flags(le, runtime.controller_host, runtime.controller_port)


def _run_train(le: LaunchEnv, train_args: list[str]) -> int:
    os.environ["MILES_NUM_NODES"] = str(le.num_nodes)
    try:
        from miles import cli
    except ImportError as e:
        raise SystemExit(f"miles.launch cannot import miles.cli ({e}); is the package complete?") from e
    result = cli.main(["train", *train_args])
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
