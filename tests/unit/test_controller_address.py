"""`--controller-host` / `--controller-port`: node 0's controller binds and listens where they say, and
every other node, which runs `python -m miles.launch` with the same `miles train` args, connects there."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles import launch
from miles.config import load_config
from miles.controller.machine import Machine, plan_run
from miles.controller.preflight import PreflightError, controller_address
from miles.wire import launch_env

from harness import minimal_train_args  # isort: skip

TORCHRUN = {
    "GROUP_RANK": "0",
    "GROUP_WORLD_SIZE": "2",
    "LOCAL_WORLD_SIZE": "1",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500",
}
TRAIN = minimal_train_args(num_rollout=1, hf_checkpoint="m", prompt_data="p.jsonl")


def _cfg(*flags: str):
    return load_config([*TRAIN, *flags])


def test_flags_win_over_the_environment_on_node_zero(monkeypatch) -> None:
    monkeypatch.setenv("MILES_RUN_SECRET", "s")
    le = launch_env.launch_env({**TORCHRUN, "MILES_CONTROLLER_HOST": "10.0.0.1", "MILES_CONTROLLER_PORT": "7000"})
    assert (le.bind_host, le.controller_port) == ("10.0.0.1", 7000)
    assert controller_address(_cfg().runtime, le) == le  # unset flags keep the environment's address
    le = controller_address(_cfg("--controller-host", "192.168.1.5", "--controller-port", "7100").runtime, le)
    options = launch_env.runtime_options(le)
    assert (options["host"], options["port"], options["advertise_host"]) == ("192.168.1.5", 7100, "10.0.0.1")
    plan = plan_run(_cfg("--actor-num-gpus-per-node", "1"), Machine("cpu", 2, 1), le)
    assert {spec.env["MASTER_PORT"] for spec in plan.trainer_specs} == {"7101"}


def test_default_bind_host_on_several_nodes_is_every_interface(monkeypatch) -> None:
    monkeypatch.setenv("MILES_RUN_SECRET", "s")
    le = controller_address(_cfg().runtime, launch_env.launch_env(TORCHRUN))
    assert (launch_env.runtime_options(le)["host"], le.controller_port) == ("0.0.0.0", 29501)


@pytest.mark.parametrize("flags", [["--controller-port", "7100"], ["--controller-host", "0.0.0.0"]])
def test_controller_flags_on_one_node_are_refused(flags: list[str]) -> None:
    with pytest.raises(PreflightError, match=f"{flags[0]} applies to multi-node runs .* drop them"):
        controller_address(_cfg(*flags).runtime, launch_env.launch_env({}))


def _agent_url(monkeypatch, train_args: list[str], **env: str) -> str:
    """The controller address a node-1 launch process hands its node agent."""
    for key, value in {**TORCHRUN, "GROUP_RANK": "1", "MILES_RUN_SECRET": "s", **env}.items():
        monkeypatch.setenv(key, value)
    if "MILES_CONTROLLER_PORT" not in env:
        monkeypatch.delenv("MILES_CONTROLLER_PORT", raising=False)
    monkeypatch.setattr(launch.signal, "signal", lambda *args: None)  # leave pytest's SIGUSR1 alone
    seen: list[str] = []
    monkeypatch.setattr("miles.workers.node_agent.run_agent", lambda rank, url, key, **kw: seen.append(url) or 0)
    assert launch.main(["--", *train_args]) == 0
    return seen[0]


def test_other_nodes_connect_to_the_port_in_the_train_args(monkeypatch, tmp_path: Path) -> None:
    assert _agent_url(monkeypatch, [*TRAIN, "--controller-port", "7100"]) == "tcp://10.0.0.1:7100"
    assert _agent_url(monkeypatch, [*TRAIN, "--controller-port=7100"], MILES_CONTROLLER_PORT="7000").endswith(":7100")
    config = tmp_path / "run.yaml"
    config.write_text("runtime:\n  controller_port: 7200\n")
    assert _agent_url(monkeypatch, [*TRAIN, "--config", str(config)]) == "tcp://10.0.0.1:7200"
    assert _agent_url(monkeypatch, TRAIN, MILES_CONTROLLER_PORT="7000") == "tcp://10.0.0.1:7000"
    assert _agent_url(monkeypatch, TRAIN) == "tcp://10.0.0.1:29501"


def test_a_node_that_cannot_read_the_train_args_says_so(monkeypatch, tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="miles.launch node 1: cannot read the miles train args"):
        _agent_url(monkeypatch, [*TRAIN, "--config", str(tmp_path / "missing.yaml")])


def test_node_agents_take_the_heartbeat_of_the_train_args(monkeypatch) -> None:
    """The agent declares the controller lost after the same silence the controller allows a node."""
    for key, value in {
        **TORCHRUN,
        "GROUP_RANK": "1",
        "MILES_RUN_SECRET": "s",
        "MILES_HEARTBEAT_TIMEOUT_S": "99",
    }.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(launch.signal, "signal", lambda *args: None)
    seen: list[dict] = []
    monkeypatch.setattr("miles.workers.node_agent.run_agent", lambda rank, url, key, **kw: seen.append(kw) or 0)
    assert launch.main(["--", *TRAIN, "--heartbeat-timeout-s", "12", "--heartbeat-interval-s", "0.5"]) == 0
    assert launch.main(["--", *TRAIN]) == 0
    assert seen == [
        {"heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 12.0},
        {"heartbeat_interval_s": 1.0, "heartbeat_timeout_s": 30.0},  # the defaults of `miles train`
    ]
