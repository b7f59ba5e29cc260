"""Multi-node entry: ``python -m miles.launch [--selftest --workers-per-node K] [-- <miles train args>]``.

Start one process per node with torchrun (``--nproc-per-node 1``) or srun (one task per node).
Node 0 becomes the controller (it runs ``miles train`` with the runtime set for ``num_nodes``);
every other node runs a node agent that spawns the workers the controller places there. Where a
process sits in the job, the controller address and the run secret come from the environment as
:mod:`miles.wire.launch_env` describes.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys

from miles.wire import codec
from miles.wire.launch_env import LaunchEnv, heartbeat_settings, launch_env, resolve_run_secret, with_controller_flags

logger = logging.getLogger(__name__)


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
    le, heartbeat = _with_train_flags(launch_env(), rest, selftest=args.selftest)
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
        return run_agent(le.node_rank, f"tcp://{le.master_addr}:{le.controller_port}", key, **heartbeat)
    if args.selftest:
        return _run_selftest(le, args.workers_per_node, args.run_dir)
    return _run_train(le, rest)


def _with_train_flags(le: LaunchEnv, train_args: list[str], *, selftest: bool) -> tuple[LaunchEnv, dict[str, float]]:
    """The controller address node 0 will use and the heartbeat every node keeps: the `miles train` args
    every node was given decide both (`--controller-host/-port`, `--heartbeat-interval-s/-timeout-s`), so
    a node agent declares the controller lost after the same silence the controller allows a node. The
    self-test has no train args: MILES_HEARTBEAT_INTERVAL_S / MILES_HEARTBEAT_TIMEOUT_S set its heartbeat."""
    from miles.config import ConfigError, load_config

    if selftest:
        return le, heartbeat_settings()
    try:
        runtime = load_config(train_args, for_train=False).runtime
    except (ConfigError, OSError) as e:
        if le.node_rank == 0:  # `miles train` on this node reports it in one line
            return le, heartbeat_settings()
        raise SystemExit(f"miles.launch node {le.node_rank}: cannot read the miles train args: {e}") from None
    heartbeat = {
        "heartbeat_interval_s": runtime.heartbeat_interval_s,
        "heartbeat_timeout_s": runtime.heartbeat_timeout_s,
    }
    return with_controller_flags(le, runtime.controller_host, runtime.controller_port), heartbeat


def _run_selftest(le: LaunchEnv, workers_per_node: int, run_dir: str) -> int:
    """Node 0 acts as the controller of a run of no-op workers (the one controller entry besides `miles train`)."""
    from miles.controller.selftest import run_selftest
    from miles.wire.rpc import run_event_loop

    summary = run_event_loop(run_selftest(le, workers_per_node, run_dir))
    print(json.dumps(summary), flush=True)
    return 0 if summary["selftest"] == "ok" else 1


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
