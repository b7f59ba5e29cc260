"""Records both sides of the wire share: what to spawn (WorkerSpec), a runtime's settings, how a run fails."""

from __future__ import annotations

import dataclasses

AGENT_ROLE = "agent"  # reserved role of node agents (identity "agent:<node>")


@dataclasses.dataclass(slots=True)
class WorkerSpec:
    role: str  # "trainer" | "rollout" | "reward" | ...
    rank: int  # rank within the role
    entry: str  # "pkg.module:ClassName" of a Worker subclass
    node: int = 0  # node index from the placement plan
    env: dict[str, str] = dataclasses.field(default_factory=dict)  # extra env for this process
    init_kwargs: dict = dataclasses.field(default_factory=dict)  # codec-able kwargs for the constructor

    @property
    def name(self) -> str:
        return f"{self.role}:{self.rank}"


@dataclasses.dataclass(slots=True)
class RuntimeOptions:
    """Settings of one Runtime (the keyword arguments of ``Runtime.start``)."""

    run_dir: str
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 30.0
    register_timeout_s: float = 120.0
    transport: str = "ipc"  # "ipc" (one machine) | "tcp" (several nodes; HMAC-signed frames)
    num_nodes: int = 1
    host: str = "127.0.0.1"  # TCP bind address
    port: int = 0  # TCP port; 0 picks a free one
    advertise_host: str | None = None  # address workers use to reach the controller (default: host)
    secret: bytes | None = None  # TCP signing key
    default_timeout_s: float | None = None  # per-call timeout when a call gives none
    shutdown_grace_s: float = 5.0  # orderly-exit wait before SIGTERM/SIGKILL


class WorkerDied(RuntimeError):
    """A worker (or node agent) died, hung, or never came up; the run is being torn down."""

    def __init__(
        self,
        role: str,
        rank: int,
        pid: int | None,
        exitcode: int | None,
        signal: str | None,
        log_tail: str,
        *,
        reason: str = "exited",
        node: int = 0,
        log_path: str = "",
    ) -> None:
        self.role, self.rank, self.pid, self.node = role, rank, pid, node
        self.exitcode, self.signal, self.log_tail, self.reason, self.log_path = (
            exitcode,
            signal,
            log_tail,
            reason,
            log_path,
        )
        how = (
            f"killed by {signal}" if signal else (f"exit code {exitcode}" if exitcode is not None else "still running")
        )
        tail = log_tail.strip() or "(empty log)"
        super().__init__(
            f"worker {role}:{rank} (pid {pid}, node {node}) {reason}: {how}; "
            f"last lines of {log_path or 'its log'}:\n{tail}"
        )


class RunInterrupted(RuntimeError):
    """The controller received SIGTERM/SIGHUP; the run is being torn down."""


def validate_specs(specs: list[WorkerSpec], transport: str, num_nodes: int) -> None:
    if transport not in ("ipc", "tcp"):
        raise ValueError(f"transport={transport!r}; use 'ipc' (one machine) or 'tcp' (several nodes)")
    if num_nodes > 1 and transport != "tcp":
        raise ValueError(f"num_nodes={num_nodes} needs transport='tcp' (IPC sockets do not cross machines)")
    seen: set[str] = set()
    for s in specs:
        if s.name in seen:
            raise ValueError(f"duplicate worker {s.name}; every (role, rank) must be unique")
        if s.role == AGENT_ROLE:
            raise ValueError(f"role {AGENT_ROLE!r} is reserved for node agents")
        if not 0 <= s.node < num_nodes:
            raise ValueError(f"worker {s.name} has node={s.node} but num_nodes={num_nodes}")
        seen.add(s.name)
