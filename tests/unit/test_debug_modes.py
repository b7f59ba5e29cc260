"""Debug modes: the saved-rollout file format and the combinations refused at start-up."""

from __future__ import annotations

import math
import pickle

import pytest
import torch

from miles.config import ConfigError, load_config
from miles.controller.placement import plan_placement
from miles.rollout.debug_data import group_consecutive, load_debug_rollout, save_debug_rollout
from miles.rollout.sample import Sample, SampleStatus

from harness import minimal_train_args  # isort: skip

REQUIRED = minimal_train_args("--n-samples-per-prompt", "2", "--global-batch-size", "4", rollout_batch_size=2)


def _sample(group: int, index: int, logprob: float) -> Sample:
    return Sample(
        prompt=[{"role": "user", "content": "2+2?"}],
        tokens=[5, 6, 7, 8],
        response="4",
        response_length=2,
        label="4",
        reward={"score": 1.0 / 3.0, "acc": 1.0},
        loss_mask=[1, 0],
        rollout_log_probs=[logprob, -1e-300],
        weight_versions=[3, 4],
        status=SampleStatus.TRUNCATED,
        metadata={"rid": "x", "turns": [1, 2]},
        group_index=group,
        index=index,
    )


def test_saved_rollout_round_trips_exactly(tmp_path) -> None:
    groups = [[_sample(7, 0, -0.1), _sample(7, 1, -math.pi)], [_sample(2, 2, -2.0 / 3.0)]]
    template = str(tmp_path / "r" / "step_{rollout_id}.pt")
    path = save_debug_rollout(template, 5, groups, {"rollout/reward_mean": 0.25})
    assert path == str(tmp_path / "r" / "step_5.pt")
    got, metrics = load_debug_rollout(template, 5)
    assert [[s.to_dict() for s in g] for g in got] == [[s.to_dict() for s in g] for g in groups]
    assert got[0][1].rollout_log_probs[0] == -math.pi  # float64, not rounded through float32
    assert got[0][0].status is SampleStatus.TRUNCATED
    assert metrics == {"rollout/reward_mean": 0.25}
    # Miles' keys, plain containers only: the strict loader reads it
    payload = torch.load(path, weights_only=True)
    assert payload["rollout_id"] == 5 and len(payload["samples"]) == 3


def test_a_missing_step_names_the_flag_and_path(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match=r"--load-debug-rollout-data: no saved rollout for step 4 at .*/4\.pt"):
        load_debug_rollout(str(tmp_path / "{rollout_id}.pt"), 4)


class _Arbitrary:
    """A class no library adds to torch's safe globals (megatron-core adds argparse.Namespace, for one)."""

    def __init__(self, x: int) -> None:
        self.x = x


def test_a_file_that_asks_for_arbitrary_objects_is_refused(tmp_path) -> None:
    path = tmp_path / "0.pt"  # any class: a full unpickle would import and build it
    torch.save({"rollout_id": 0, "samples": [], "extra": _Arbitrary(1)}, path)
    with pytest.raises(pickle.UnpicklingError):
        load_debug_rollout(str(tmp_path / "{rollout_id}.pt"), 0)


def test_groups_are_consecutive_runs_of_group_index() -> None:
    samples = [_sample(g, i, -1.0) for i, g in enumerate([3, 3, 1, 1, 1, 3])]
    assert [[s.index for s in g] for g in group_consecutive(samples)] == [[0, 1], [2, 3, 4], [5]]


def _errors(*argv: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_config([*REQUIRED, *argv])
    return str(info.value)


def test_load_implies_train_only_and_the_first_file_must_exist(tmp_path) -> None:
    template = str(tmp_path / "{rollout_id}.pt")
    assert "no saved rollout for the first step (0)" in _errors("--load-debug-rollout-data", template)
    assert "no saved rollout for the first step (2)" in _errors(
        "--load-debug-rollout-data", template, "--start-rollout-id", "2"
    )
    save_debug_rollout(template, 0, [[_sample(0, 0, -1.0)]])
    cfg = load_config([*REQUIRED, "--load-debug-rollout-data", template, "--eval-interval", "none"])
    assert cfg.runtime.debug_train_only


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--debug-train-only"], "--debug-train-only needs --load-debug-rollout-data"),
        (["--debug-train-only", "--debug-rollout-only"], "pick one"),
        (["--debug-rollout-only", "--fully-async"], "--debug-rollout-only is supported by the sync loop only"),
        (["--save-debug-rollout-data", "r/{rollout_id}.pt", "--fully-async"], "sync loop only; drop --fully-async"),
        (["--dump-details", "d", "--fully-async"], "--dump-details is supported by the sync loop only"),
        (["--save-debug-rollout-data", "r/rollout.pt"], "needs '{rollout_id}' in the path"),
        (["--save-debug-rollout-data", "r/{step}.pt"], "needs '{rollout_id}' in the path"),
        (["--debug-rollout-only", "--save", "ckpt"], "--debug-rollout-only starts no trainer"),
        (
            [
                "--debug-train-only",
                "--load-debug-rollout-data",
                "r/{rollout_id}.pt",
                "--eval-interval",
                "5",
                "--eval-prompt-data",
                "a",
                "a.jsonl",
            ],
            "add --eval-interval none",
        ),
    ],
)
def test_refused_combinations(argv, expected) -> None:
    assert expected in _errors(*argv)


def test_dump_details_sets_the_rollout_dump_unless_it_is_given() -> None:
    assert (
        load_config([*REQUIRED, "--dump-details", "d"]).runtime.save_debug_rollout_data
        == "d/rollout_data/{rollout_id}.pt"
    )
    given = load_config([*REQUIRED, "--dump-details", "d", "--save-debug-rollout-data", "x/{rollout_id}.pt"])
    assert given.runtime.save_debug_rollout_data == "x/{rollout_id}.pt"


def test_each_mode_plans_one_side_only(tmp_path) -> None:
    template = str(tmp_path / "{rollout_id}.pt")
    save_debug_rollout(template, 0, [[_sample(0, 0, -1.0)]])
    rollout_only = load_config([*REQUIRED, "--debug-rollout-only"])
    train_only = load_config([*REQUIRED, "--load-debug-rollout-data", template])
    p = plan_placement(rollout_only, device="cpu")
    assert (len(p.trainer_specs), len(p.rollout_specs)) == (0, 1)
    p = plan_placement(train_only, device="cpu")
    assert (len(p.trainer_specs), len(p.rollout_specs)) == (1, 0)
