"""The `runtime` section: run directory, timeouts, multi-node, profiling, debug modes."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from miles.config.option import PORT_RANGE, option


@dataclass
class RuntimeConfig:
    """Run directory, timeouts, multi-node, profiling, debug modes."""

    output_dir: str | None = option(None, "run directory (default runs/<name>-<timestamp>)")
    run_name: str = option("miles", "run name")
    heartbeat_interval_s: float = option(1.0, "worker heartbeat period", range="(0, 3600]", unit="seconds")
    heartbeat_timeout_s: float = option(
        30.0, "declare a worker hung after this silence", range="(0, inf)", unit="seconds"
    )
    rpc_timeout_s: float = option(600.0, "default RPC timeout", range="(0, inf)", unit="seconds")
    controller_host: str | None = option(
        None,
        "address node 0's controller binds in a multi-node run (python -m miles.launch); default: MILES_CONTROLLER_HOST, else 0.0.0.0",
    )
    controller_port: int = option(
        0,
        "port node 0's controller listens on in a multi-node run; every node reads it from the same miles train args; 0: MILES_CONTROLLER_PORT, else MASTER_PORT + 1",
        range=PORT_RANGE,
        unit="a TCP port; 0 picks a free one",
    )
    num_nodes: int | None = option(
        None,
        "nodes of the job (default: from torchrun/Slurm, else 1); a real run refuses a count that differs from the launch",
        range="[1, 4096]",
        unit="nodes",
    )
    num_gpus_per_node: int | None = option(
        None,
        "GPUs of each node (default: the CUDA devices this node sees; none: a CPU plan); with --dry-run, plans a GPU layout on any machine",
        range="[0, 1024]",
        unit="GPUs; 0 is a CPU plan",
    )
    dry_run: bool = option(False, "check the config, print it and the placement plan as JSON, start nothing")
    profile_steps: list[int] = option(
        [], "steps traced with torch.profiler", nargs="*", range="[0, inf)", unit="step indices"
    )
    py_spy: bool = option(False, "sample workers with py-spy")
    debug_rollout_only: bool = option(
        False,
        "engines only: no trainer is started, rollouts are generated step after step with the initial weights (save them with --save-debug-rollout-data)",
    )
    debug_train_only: bool = option(
        False,
        "trainer only: no engine is started, each step trains on the rollout read from --load-debug-rollout-data (implied by it)",
    )
    save_debug_rollout_data: str | None = option(
        None,
        "write each step's rollout (samples with tokens, rewards, log-probs, loss masks, weight versions, metadata) to this path; {rollout_id} in it is replaced by the step (by eval_<weight version> for each evaluation's samples)",
    )
    dump_details: str | None = option(
        None,
        "write the run's debug dumps under this directory: every step's rollout and every evaluation's samples, "
        "as --save-debug-rollout-data writes them, to DIR/rollout_data/{rollout_id}.pt (sets "
        "--save-debug-rollout-data when that is not given)",
    )
    load_debug_rollout_data: str | None = option(
        None,
        "train each step on the rollout saved at this path ({rollout_id} replaced by the step) instead of generating; implies --debug-train-only",
    )

    def derive(self) -> None:
        """The values this section derives from its own flags (an explicit value stays)."""
        if self.output_dir is None:
            self.output_dir = f"runs/{self.run_name}-{time.strftime('%Y%m%d-%H%M%S')}"
        if self.dump_details and self.save_debug_rollout_data is None:  # Miles: --dump-details sets the dump paths
            self.save_debug_rollout_data = os.path.join(self.dump_details, "rollout_data", "{rollout_id}.pt")
