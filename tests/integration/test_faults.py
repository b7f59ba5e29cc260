"""Fault injection through `miles train`, as a user meets it: nothing silent, nothing unbounded.

Each run is the CPU demo (tiny model, 4 groups of 4 a step) with a faulty plug-in from
fault_plugins.py: a reward that returns None, NaN or a string, a filter that rejects every group,
a reward so large that the loss overflows; and a bad flag. A run that cannot go on stops with one
line that names the cause (exit status 1), a stop signal ends even a run that can never finish a
step, no worker outlives the run, and no checkpoint holds a step that was not trained cleanly.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import torch
from e2e_helpers import REPO, leftover_processes, read_rows, train_command
from harness import SMALL_RUN

from _trainer_harness import configs, make_batch, make_tiny_model, run_ranks, shard  # isort: skip

from miles.errors import NonFiniteTraining
from miles.trainer.checkpoint import COMPLETE_MARKER, checkpoint_dir, latest_complete_checkpoint

PLUGINS = str(Path(__file__).resolve().parent)


def _cmd(out_dir: Path, *flags: str) -> list[str]:
    return train_command(out_dir, *SMALL_RUN, *flags)


def _env() -> dict[str, str]:
    return {**os.environ, "MILES_TORCH_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(REPO), PLUGINS])}


def _train(out_dir: Path, *flags: str, timeout_s: float = 300) -> subprocess.CompletedProcess:
    """Run to the end; the run must leave no process behind whatever its exit status."""
    proc = subprocess.run(
        _cmd(out_dir, *flags), cwd=REPO, env=_env(), capture_output=True, text=True, timeout=timeout_s
    )
    assert not leftover_processes(str(out_dir)), "processes of the run are still alive"
    return proc


def _last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


def test_a_reward_that_returns_none_stops_the_run_with_the_cause(tmp_path) -> None:
    proc = _train(
        tmp_path,
        "--num-rollout",
        "3",
        "--custom-rm-path",
        "fault_plugins:none_reward",
        "--rollout-max-consecutive-drops",
        "16",
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    line = _last_line(proc.stderr)
    assert line.startswith(
        "miles train: rollout 0: the last 16 groups (64 samples) were all dropped "
        "(reward_failed 16); 0 of 4 groups accepted."
    ), line
    assert "--custom-rm-path fault_plugins:none_reward returned None (NoneType)" in line
    assert "Traceback" not in proc.stderr
    named = r"reward failed for sample \d+ \(group \d+\): --custom-rm-path fault_plugins:none_reward returned None"
    assert re.search(named, proc.stderr)  # each sample is named as it fails


def test_a_filter_that_rejects_every_group_stops_the_run_naming_it(tmp_path) -> None:
    proc = _train(
        tmp_path, "--num-rollout", "3", "--dynamic-sampling-filter-path", "fault_plugins:reject_every_group"
    )  # the default limit: 16 refills of 4 groups
    assert proc.returncode == 1, proc.stderr[-3000:]
    line = _last_line(proc.stderr)
    assert "the last 64 groups (256 samples) were all dropped (dynamic_filter/drop_filtered 64)" in line, line
    assert "The dynamic sampling filter --dynamic-sampling-filter-path fault_plugins:reject_every_group" in line


def test_fully_async_generation_that_drops_everything_stops_too(tmp_path) -> None:
    proc = _train(
        tmp_path,
        "--num-rollout",
        "3",
        "--fully-async",
        "--custom-rm-path",
        "fault_plugins:none_reward",
        "--rollout-max-consecutive-drops",
        "16",
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    line = _last_line(proc.stderr)
    assert line.startswith("miles train: fully async generation: the last 16 groups"), line
    assert "returned None (NoneType)" in line


def test_bad_reward_values_are_counted_and_named_and_the_run_goes_on(tmp_path) -> None:
    proc = _train(tmp_path, "--num-rollout", "3", "--custom-rm-path", "fault_plugins:nan_or_string_reward")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [r for r in read_rows(tmp_path) if r["step"] >= 0]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[0]["rollout/reward_failed_groups"] >= 1  # group 0, in the first refill
    # 2 bad samples in each failed group (groups still in flight at the end of a step may add more)
    assert all(r["rollout/reward_failed_samples"] >= 2 * r.get("rollout/reward_failed_groups", 0) for r in rows)
    assert "returned nan (float); a reward must be a finite number" in proc.stderr
    assert "returned '1.0' (str); a reward must be a finite number" in proc.stderr


def test_sigterm_stops_a_rollout_that_can_never_finish_and_saves_the_last_step(tmp_path) -> None:
    """Steps 0 and 1 train; from step 2 every reward is None and the drop limit is out of reach. One
    SIGTERM ends the run: the rollout is abandoned and step 1 is the checkpoint."""
    out, save = tmp_path / "run", tmp_path / "ckpt"
    err_path = tmp_path / "stderr.txt"
    with open(err_path, "w") as err:
        proc = subprocess.Popen(
            _cmd(
                out,
                "--num-rollout",
                "5",
                "--custom-rm-path",
                "fault_plugins:none_reward_late",
                "--rollout-max-consecutive-drops",
                "100000000",
                "--save",
                str(save),
            ),
            cwd=REPO,
            env=_env(),
            stdout=subprocess.DEVNULL,
            stderr=err,
            text=True,
        )
    try:
        deadline = time.monotonic() + 240
        while "rollout 2: the last" not in err_path.read_text():  # the retry loop's progress line
            assert proc.poll() is None, f"the run ended early:\n{err_path.read_text()[-3000:]}"
            assert time.monotonic() < deadline, "no retry progress line within 240 s"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stderr = err_path.read_text()
    assert proc.returncode == 0, stderr[-3000:]
    assert "received SIGTERM" in stderr and "rollout 2 abandoned by the stop signal" in stderr
    assert Path(latest_complete_checkpoint(str(save))).name == "iter_0000001"
    assert not leftover_processes(str(out)), "processes of the run are still alive"


def test_a_loss_that_overflows_stops_at_its_step_and_is_never_saved(tmp_path) -> None:
    """Rewards of 3e38 from step 2 on (normalisation off): the loss overflows float32. The run stops
    naming step 2, before the optimizer applies the update; steps 0 and 1 are saved, step 2 is not."""
    save = tmp_path / "ckpt"
    proc = _train(
        tmp_path / "run",
        "--num-rollout",
        "4",
        "--custom-rm-path",
        "fault_plugins:huge_reward_late",
        "--disable-rewards-normalization",
        "--save",
        str(save),
        "--save-interval",
        "1",
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    line = _last_line(proc.stderr)
    assert line.startswith("miles train: step 2 (optimizer step 1 of 1): the actor has "), line
    assert "the update was not applied and this step is not saved" in line
    assert sorted(p.name for p in save.iterdir() if p.name.startswith("iter_")) == ["iter_0000000", "iter_0000001"]
    assert [r["step"] for r in read_rows(tmp_path / "run") if r["step"] >= 0] == [0, 1]


def test_lr_inf_is_refused_at_start_up_with_one_line(tmp_path) -> None:
    proc = _train(tmp_path / "run", "--lr", "inf", timeout_s=60)
    assert proc.returncode == 2
    problems = [line for line in proc.stderr.splitlines() if " INFO " not in line]
    assert problems == ["config error: --lr=inf is not a finite number; give a real value (default 1e-06)"]
    assert not (tmp_path / "run").exists()  # refused before anything started


# ---- the trainer itself, on 2 FSDP ranks (gloo) -------------------------------------------------


def _guarded_rank(rank: int, world: int, model_dir: str, root: str) -> None:
    """Rewards of 3e38: train refuses before the optimizer step, on both ranks, weights untouched. A NaN
    planted in one rank's shard: save refuses on both ranks and writes no complete checkpoint."""
    from miles.trainer.backend import create_backend

    be = create_backend("fsdp", **configs(model_dir, rollout=dict(global_batch_size=4)))
    be.setup()
    before = {n: t.clone() for n, t in be.named_hf_tensors()}
    batch = make_batch(4, seed=3)
    batch.rewards = np.array([1.0, 3e38, 3e38, 1.0], np.float32)  # finite; their token sums overflow
    report = {}
    try:
        be.train(shard(batch, rank, world, 4), rollout_id=7)
    except NonFiniteTraining as e:
        report["train_error"] = str(e)
    report["unchanged"] = all(torch.equal(t, before[n]) for n, t in be.named_hf_tensors())
    if rank == 1:
        with torch.no_grad():
            next(be.actor.parameters()).to_local().view(-1)[0] = float("nan")
    try:
        be.save(checkpoint_dir(os.path.join(root, "save"), 7), {})
    except NonFiniteTraining as e:
        report["save_error"] = str(e)
    torch.save(report, os.path.join(root, f"guard{rank}.pt"))


def test_the_trainer_refuses_a_non_finite_step_and_a_non_finite_checkpoint(tmp_path) -> None:
    model_dir = make_tiny_model(str(tmp_path / "model"))
    run_ranks(_guarded_rank, 2, model_dir, str(tmp_path))
    for rank in range(2):
        r = torch.load(tmp_path / f"guard{rank}.pt", weights_only=False)
        assert r["train_error"].startswith("step 7 (optimizer step 1 of 1): the actor has "), r["train_error"]
        assert r["unchanged"], "a refused step changed the weights"
        assert (
            r["save_error"].startswith("refusing to save ")
            and "1 parameter shard(s) hold NaN or inf" in r["save_error"]
        )
    assert not (tmp_path / "save" / "iter_0000007" / COMPLETE_MARKER).exists()
    assert latest_complete_checkpoint(str(tmp_path / "save")) is None


def test_a_killed_engine_ends_the_run_with_one_line_naming_it(tmp_path) -> None:
    """SIGKILL the rollout engine once a step is done: the run stops with exit status 1 and one last line
    naming the worker, how it died and its log; no retry storm, no unretrieved task errors."""
    out = tmp_path / "run"
    err_path = tmp_path / "stderr.txt"
    with open(err_path, "w") as err:
        proc = subprocess.Popen(
            _cmd(out, "--num-rollout", "200"), cwd=REPO, env=_env(), stdout=subprocess.DEVNULL, stderr=err, text=True
        )
    try:
        deadline = time.monotonic() + 240
        while not (out / "metrics.jsonl").exists() or not read_rows(out):
            assert proc.poll() is None, f"the run ended early:\n{err_path.read_text()[-3000:]}"
            assert time.monotonic() < deadline, "no finished step within 240 s"
            time.sleep(0.2)
        pid = int(re.search(r"rollout:0 pid=(\d+)", (out / "logs" / "rollout_0.log").read_text()).group(1))
        os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stderr = err_path.read_text()
    assert proc.returncode == 1, stderr[-3000:]
    last = _last_line(stderr)
    assert last.startswith("miles train: worker rollout:0 ") and "SIGKILL" in last and "rollout_0.log" in last, last
    assert "Task exception was never retrieved" not in stderr
    assert "Traceback" not in stderr
    assert stderr.count("WARNING") <= 3, stderr[-3000:]
    assert not leftover_processes(str(out)), "processes of the run are still alive"


def test_a_checkpoint_records_the_version_of_the_weights_it_holds(tmp_path) -> None:
    """The weights saved after step k are the ones pushed to the engines as version k + 1: a resume starts the
    engines at that version, as the run that never stopped would have had them."""
    save = tmp_path / "ck"
    proc = _train(tmp_path / "run", "--num-rollout", "2", "--save", str(save), "--save-interval", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    pushed = {row["step"]: row["rollout/weight_version"] for row in read_rows(tmp_path / "run") if row["step"] >= 0}
    for step in (0, 1):
        meta = json.loads((Path(checkpoint_dir(str(save), step)) / "meta.json").read_text())["extra_state"]
        assert meta["weight_version"] == pushed[step] == step + 1, (step, meta, pushed)
