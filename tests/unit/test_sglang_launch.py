"""`miles train --engine sglang`: the Miles engine flags reach `sglang.launch_server` under SGLang's names,
and what a launched SGLang server cannot do is refused at start-up, before any worker starts."""

import pytest

from miles.config import ConfigError, load_config
from miles.controller.placement import plan_placement
from miles.engines.sglang_engine import build_sglang_command, with_engine_dtype

from harness import minimal_train_args  # isort: skip

SGLANG = minimal_train_args("--engine", "sglang", num_rollout=2)


def launch_command(*flags: str, engine: tuple[str, ...] = SGLANG) -> list[str]:
    """The command line the rollout worker of this config would run (as its `on_start` builds it)."""
    plan = plan_placement(load_config([*engine, *flags]), device="cuda", num_nodes=1, gpus_per_node=2, master_port=1)
    kwargs = plan.rollout_specs[0].init_kwargs
    return build_sglang_command("/m", 1, sglang_args=with_engine_dtype(kwargs["sglang_args"], kwargs["dtype"]))


def value_of(cmd: list[str], flag: str) -> str | None:
    return cmd[cmd.index(flag) + 1] if flag in cmd else None


def test_engine_flags_reach_sglang_under_its_names():
    cmd = launch_command("--deterministic", "--max-running-requests", "24", "--max-total-tokens", "5000")
    assert "--enable-deterministic-inference" in cmd
    assert value_of(cmd, "--max-running-requests") == "24"
    assert value_of(cmd, "--max-total-tokens") == "5000"


def test_unset_engine_flags_leave_sglang_its_own_defaults():
    cmd = launch_command()
    assert "--enable-deterministic-inference" not in cmd
    assert "--max-running-requests" not in cmd  # not the embedded engine's 64
    assert "--max-total-tokens" not in cmd  # not the KV size the embedded engine would derive


def test_the_passthrough_still_reaches_sglang():
    cmd = launch_command("--sglang-max-running-requests", "48", "--sglang-mem-fraction-static", "0.7")
    assert (value_of(cmd, "--max-running-requests"), value_of(cmd, "--mem-fraction-static")) == ("48", "0.7")


def test_the_embedded_engine_keeps_its_own_sizing():
    # 32 groups of 4 per step: more than the embedded engine's default of 64 running requests
    base = minimal_train_args("--n-samples-per-prompt", "4", num_rollout=2, rollout_batch_size=32)
    plan = plan_placement(load_config(base), device="cpu")
    kwargs = plan.rollout_specs[0].init_kwargs
    assert kwargs["max_running_requests"] == 64 and kwargs["max_total_tokens"] > 0 and kwargs["sglang_args"] == {}
    plan = plan_placement(load_config([*base, "--max-running-requests", "8"]), device="cpu")
    assert plan.rollout_specs[0].init_kwargs["max_running_requests"] == 8
    # a step of 4 groups of 4 fills 16 slots at most: the engine holds no more (placement.engine_slots)
    small = minimal_train_args("--n-samples-per-prompt", "4", num_rollout=2, rollout_batch_size=4)
    assert plan_placement(load_config(small), device="cpu").rollout_specs[0].init_kwargs["max_running_requests"] == 16


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--http-max-body-mb", "8"], "--http-max-body-mb=8.0 limits the embedded engine's request bodies"),
        (["--update-weight-transfer-mode", "disk-delta"], "--update-weight-transfer-mode=disk-delta patches"),
        (["--check-weight-update-equal"], "--check-weight-update-equal needs the digest weight checker"),
        (["--max-running-requests", "8", "--sglang-max-running-requests", "9"], "give it once"),
        (["--max-total-tokens", "800", "--sglang-max-total-tokens", "900"], "--max-total-tokens and --sglang-max"),
    ],
)
def test_what_sglang_cannot_do_is_refused_at_start_up(flags, needle):
    with pytest.raises(ConfigError) as info:
        load_config([*SGLANG, *flags])
    assert needle in str(info.value)
    load_config([*minimal_train_args(num_rollout=2), *flags[:2]])  # the embedded engine takes the first flag
