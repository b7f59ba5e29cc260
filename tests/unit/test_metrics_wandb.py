"""The metrics sink's W&B side, against a fake `wandb` module: the resolved config is logged with its
secrets blanked, a run restarted with `--load` resumes the same W&B run, and `--wandb-mode` reaches
`wandb.init`."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import pytest

from miles.config import ConfigError, load_config
from miles.utils.metrics import WANDB_ID_FILE, MetricsSink, read_metrics

from harness import minimal_train_args, requires  # isort: skip


class FakeRun:
    def __init__(self) -> None:
        self.logged: list[tuple[dict[str, Any], int]] = []
        self.finished = False

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self.logged.append((metrics, step))

    def finish(self) -> None:
        self.finished = True


@pytest.fixture
def fake_wandb(monkeypatch) -> list[tuple[dict[str, Any], FakeRun]]:
    """Every wandb.init call: its kwargs and the run it returned."""
    calls: list[tuple[dict[str, Any], FakeRun]] = []

    def init(**kwargs: Any) -> FakeRun:
        run = FakeRun()
        calls.append((kwargs, run))
        return run

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    return calls


def _cfg(*flags: str):
    wandb = ("--use-wandb", "--wandb-project", "proj", "--api-key", "s3cret")
    return load_config(minimal_train_args(*wandb, *flags, num_rollout=2, hf_checkpoint="m", prompt_data="p.jsonl"))


def _sink(cfg, run_dir: Path) -> MetricsSink:
    """Built as setup.open_sink builds it."""
    return MetricsSink(
        str(run_dir),
        tensorboard=False,
        wandb_project=cfg.logging.wandb_project,
        wandb_group=cfg.logging.wandb_group,
        run_name=cfg.runtime.run_name,
        config=cfg.to_dict(),
        wandb_mode=cfg.logging.wandb_mode,
        resume_from=cfg.train.load,
        checkpoint_root=cfg.train.save,
    )


def test_wandb_logs_the_resolved_config_without_secrets_and_every_step(tmp_path: Path, fake_wandb) -> None:
    cfg = _cfg("--wandb-group", "g", "--lr", "3e-6")
    assert cfg.engine.api_key == "s3cret"
    sink = _sink(cfg, tmp_path / "run")
    sink.log(1, {"train/loss": 0.5, "perf/nan": float("nan")})
    sink.close()
    [(kwargs, run)] = fake_wandb
    assert kwargs["project"] == "proj" and kwargs["group"] == "g" and kwargs["dir"] == str(tmp_path / "run")
    assert kwargs["config"]["train"]["lr"] == 3e-6 and kwargs["config"]["rollout"]["num_rollout"] == 2
    assert kwargs["config"]["engine"]["api_key"] is None and "s3cret" not in repr(kwargs["config"])
    assert "mode" not in kwargs  # unset: wandb's own default (WANDB_MODE, else online)
    assert run.logged == [({"train/loss": 0.5, "perf/nan": None}, 1)] and run.finished
    assert read_metrics(str(tmp_path / "run")) == [{"step": 1, "perf/nan": None, "train/loss": 0.5}]


@pytest.mark.parametrize("mode", ["offline", "disabled", "online"])
def test_wandb_mode_reaches_wandb_init(tmp_path: Path, fake_wandb, mode: str) -> None:
    _sink(_cfg("--wandb-mode", mode), tmp_path).close()
    assert fake_wandb[0][0]["mode"] == mode


def test_unknown_wandb_mode_is_refused() -> None:
    with pytest.raises(ConfigError, match="--wandb-mode='offlne' is not one of online, offline, disabled"):
        _cfg("--wandb-mode", "offlne")


def test_a_run_resumed_with_load_continues_its_wandb_run(tmp_path: Path, fake_wandb) -> None:
    ckpt = tmp_path / "ckpt"
    _sink(_cfg("--save", str(ckpt)), tmp_path / "run1").close()
    first = fake_wandb[0][0]
    assert first["resume"] == "allow" and first["id"]
    assert (ckpt / WANDB_ID_FILE).read_text().strip() == first["id"]  # beside the checkpoints
    assert (tmp_path / "run1" / WANDB_ID_FILE).read_text().strip() == first["id"]

    # a requeued job (`--load X --save X`), and one loading an iter_* directory from another run directory
    _sink(_cfg("--load", str(ckpt), "--save", str(ckpt)), tmp_path / "run2").close()
    (ckpt / "iter_0000002").mkdir()
    _sink(_cfg("--load", str(ckpt / "iter_0000002")), tmp_path / "run3").close()
    assert [kw["id"] for kw, _ in fake_wandb] == [first["id"]] * 3
    assert all(kw["resume"] == "allow" for kw, _ in fake_wandb)


def test_a_fresh_run_starts_a_new_wandb_run(tmp_path: Path, fake_wandb) -> None:
    _sink(_cfg("--save", str(tmp_path / "a")), tmp_path / "run").close()
    _sink(_cfg("--save", str(tmp_path / "b")), tmp_path / "run").close()  # same run dir, no --load
    ids = [kw["id"] for kw, _ in fake_wandb]
    assert ids[0] != ids[1]
    assert (tmp_path / "run" / WANDB_ID_FILE).read_text().strip() == ids[1]


def test_load_without_a_stored_id_starts_a_new_wandb_run(tmp_path: Path, fake_wandb) -> None:
    (tmp_path / "foreign").mkdir()  # a checkpoint from a run that did not log to W&B
    _sink(_cfg("--load", str(tmp_path / "foreign")), tmp_path / "run").close()
    assert (tmp_path / "run" / WANDB_ID_FILE).read_text().strip() == fake_wandb[0][0]["id"]


def test_without_tensorboard_the_run_says_how_to_get_it_and_keeps_metrics_jsonl(
    tmp_path: Path, monkeypatch, caplog
) -> None:
    monkeypatch.setitem(sys.modules, "tensorboard.compat.proto", None)  # import fails as if not installed
    sink = MetricsSink(str(tmp_path), tensorboard=True)
    sink.log(0, {"rollout/reward_mean": 0.5})
    sink.close()
    assert "pip install 'miles[tensorboard]', or --no-use-tensorboard" in caplog.text
    assert read_metrics(str(tmp_path))[0]["rollout/reward_mean"] == 0.5
    assert not (tmp_path / "tensorboard").exists()


@requires("tensorboard")
def test_tensorboard_scalars_read_back_with_tensorboards_reader(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sink = MetricsSink(str(tmp_path), tensorboard=True)
    sink.log(0, {"rollout/reward_mean": 0.25, "perf/step_time": 1.5, "note": "text is not a scalar"})
    sink.log(1, {"rollout/reward_mean": 0.75, "flag": True})
    sink.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert sorted(acc.Tags()["scalars"]) == ["perf/step_time", "rollout/reward_mean"]
    assert [(e.step, e.value) for e in acc.Scalars("rollout/reward_mean")] == [(0, 0.25), (1, 0.75)]
