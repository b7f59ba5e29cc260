"""The GSM bench pieces on CPU: the summary's curve, gain and medians; e2e_vs_trl's gsm job wiring."""

from __future__ import annotations

import argparse

import pytest

from bench_modules import load_bench  # isort: skip  (same folder, rootdir on sys.path)


def test_the_summary_reads_the_eval_curve_and_step_medians() -> None:
    summary = load_bench("gsm_summary")
    rows = [
        {"step": 0, "perf/step_time": 9.0, "perf/train/mfu": 0.1, "rollout/reward_mean": 0.2,
         "eval/gsm_orig/reward_mean": 0.3, "perf/peak_mem_gb/update": 40.0, "perf/startup_time": 25.0,
         "perf/startup/data": 3.0, "perf/startup/eval_before_train": 10.0},
        {"step": 1, "perf/step_time": 4.0, "perf/train/mfu": 0.3, "rollout/reward_mean": 0.4, "perf/peak_mem_gb/update": 42.0},
        {"step": 2, "perf/step_time": 5.0, "perf/train/mfu": 0.2, "rollout/reward_mean": 0.6,
         "eval/gsm_orig/reward_mean": 0.5, "perf/peak_mem_gb/log_probs": 30.0},
    ]  # fmt: skip
    out = summary.summarize(rows, skip_first=1)
    assert out["step_s"] == 4.5 and out["mfu"] == 0.25  # medians without the first step
    assert out["gsm_orig_curve"] == [(0, 0.3), (2, 0.5)] and out["gsm_orig_gain"] == 0.2
    assert out["peak_mem_gb"] == {"log_probs": 30.0, "update": 42.0} and out["startup_s"] == 25.0
    assert out["startup_without_eval_s"] == 15.0 and out["startup_phases_s"]["data"] == 3.0
    assert out["first_step_s"] == 9.0  # the warm-up step, reported on its own
    assert out["reward_last5"] == 0.4 and "gsm_heldout_curve" not in out


def test_the_summary_names_the_trainers_attention(tmp_path) -> None:
    summary = load_bench("gsm_summary")
    assert summary.trainer_attention(tmp_path) is None
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "trainer_0.log").write_text(
        "2026-12-04 INFO trainer:0 miles.trainer.hf_io: trainer attention: miles_varlen (flash kernel checked)\n"
    )
    assert summary.trainer_attention(tmp_path) == "miles_varlen (flash kernel checked)"


def test_the_summary_says_where_the_trainers_set_up_went(tmp_path) -> None:
    summary = load_bench("gsm_summary")
    assert summary.trainer_setup(tmp_path) is None
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "trainer_0.log").write_text(
        "2026-12-05 INFO trainer:0 miles.workers.trainer_worker: trainer set up in 3.4 s (process group 0.0 s, "
        "backend import 0.8 s, model and optimizer 2.6 s), from 1.8 s after its process started\n"
    )
    assert summary.trainer_setup(tmp_path).startswith("3.4 s (process group 0.0 s, backend import 0.8 s")


def test_the_gsm_job_takes_the_committed_data_and_its_reward() -> None:
    e2e = load_bench("e2e_job")
    args = argparse.Namespace(job="gsm", long_tokens=512)
    assert e2e.job_data(args, None) == e2e.GSM_DATA and e2e.GSM_DATA.is_file()
    assert e2e.max_new_tokens(args) == 512 and e2e.TEMPERATURE["gsm"] == 1.0
    from miles.recipes.gsm_symbolic import score

    assert score("so \\boxed{18}<|im_end|>", "18") == 1.0 and score("18 apples", "17") == 0.0
    assert e2e.REWARD["gsm"] == "miles.recipes.gsm_symbolic.reward"


def test_the_eval_dump_reader_scores_versions_and_compares_templates(tmp_path) -> None:
    from miles.rollout.debug_data import save_debug_rollout
    from miles.rollout.sample import Sample, SampleStatus

    dump = load_bench("eval_dump")

    def sample(index: int, template: str, text: str, reward: float, truncated: bool = False) -> Sample:
        status = SampleStatus.TRUNCATED if truncated else SampleStatus.COMPLETED
        meta = {"template": template, "eval_dataset": "gsm_heldout"}
        return Sample(response=text, response_length=10, reward=reward, status=status, metadata=meta, index=index)

    template = str(tmp_path / "rollout_data" / "{rollout_id}.pt")
    before = [sample(0, "0001", "so \\boxed{3}", 1.0), sample(1, "0001", "it is 4", 0.0, truncated=True),
              sample(2, "0002", "\\boxed{5}", 0.0), sample(3, "0002", "#### 6", 0.0)]  # fmt: skip
    after = [sample(0, "0001", "\\boxed{3}", 1.0), sample(1, "0001", "\\boxed{4}", 0.0),
             sample(2, "0002", "\\boxed{5}", 1.0), sample(3, "0002", "The answer is 6", 1.0)]  # fmt: skip
    save_debug_rollout(template, "eval_0", [before])
    save_debug_rollout(template, "eval_20", [after])
    save_debug_rollout(template, 3, [before])  # a step's rollout beside them is not an evaluation

    evals = dump.load_evals(tmp_path / "rollout_data")
    out = dump.summarize(evals, None, top=5)["gsm_heldout"]
    assert out["by_version"][0] == {"n": 4, "accuracy": 0.25, "truncated": 0.25, "unmarked": 0.25, "response_len": 10}
    assert out["by_version"][20]["accuracy"] == 0.75 and out["by_version"][20]["unmarked"] == 0.0
    t = out["templates"]
    assert (t["templates"], t["gained"], t["lost"], t["unchanged"]) == (2, 1, 0, 1)
    assert t["largest_gains"] == [{"template": "0002", "change": 1.0}]
    # question by question: changes 0, 0, +1, +1; over templates 0 and +1 (two observations, t at 1 df)
    g = out["gains"][20]
    assert (g["questions"], g["gain"], g["templates"]) == (4, 0.5, 2)
    assert g["ci95_questions"] == pytest.approx(3.182 * 0.57735 / 2, abs=1e-3)
    assert g["ci95_templates"] == pytest.approx(12.706 * 0.70711 / 2**0.5, abs=1e-3)
    assert dump.gain(evals[0], evals[20][:1]) is None  # one common question: no interval
    assert dump.main([str(tmp_path)]) == 0  # DIR or DIR/rollout_data
