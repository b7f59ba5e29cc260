"""bench/e2e_vs_trl.py --trl-rewards: a miles-only call paired with TRL's stored per-seed lines."""

from __future__ import annotations

import json

import pytest

from bench_modules import load_bench  # isort: skip

bench = load_bench("e2e_vs_trl")
job = load_bench("e2e_job")
stats = load_bench("e2e_stats")
trl_side = load_bench("e2e_trl")
STORED = job.REPO / "bench/results/e2e_vs_trl_short_trl_seeds.jsonl"


def _args(tmp_path, lines, **kw):
    path = tmp_path / "trl.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    argv = ["--sides", "miles", "--trl-rewards", str(path), "--steps", "3"]
    for k, v in kw.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    return bench.parse_args(argv)


def test_the_seeds_of_the_call_are_taken_from_the_file(tmp_path):
    lines = [{"side": "trl", "seed": k, "rewards": [0.1 * k] * 3} for k in range(4)]
    stored = trl_side.load_trl_rewards(_args(tmp_path, lines, first_seed=2, seeds=2), "cpu")
    assert [d["seed"] for d in stored] == [2, 3]
    miles = [{"rewards": [0.3, 0.3, 0.3]}, {"rewards": [0.2, 0.2, 0.2]}]
    paired = stats.paired_last5(miles, stored)
    assert paired["reward_last5_diff"] == pytest.approx([0.1, -0.1])


def test_missing_seeds_or_steps_and_a_trl_side_are_refused(tmp_path):
    lines = [{"side": "trl", "seed": 0, "rewards": [0.1] * 3}, {"side": "trl", "seed": 1, "rewards": [0.1] * 2}]
    with pytest.raises(SystemExit, match=r"seed\(s\) \[1, 2\]"):
        trl_side.load_trl_rewards(_args(tmp_path, lines, seeds=3), "cpu")
    args = _args(tmp_path, lines)
    args.sides = ["miles", "trl"]
    with pytest.raises(SystemExit, match="--sides miles"):
        trl_side.load_trl_rewards(args, "cpu")


def test_the_stored_h200_runs_cover_seeds_0_to_5():
    stored = trl_side.load_trl_rewards(
        bench.parse_args(["--sides", "miles", "--seeds", "6", "--trl-rewards", str(STORED)]), "cuda"
    )
    assert [d["seed"] for d in stored] == list(range(6)) and all(len(d["rewards"]) == 30 for d in stored)
    with pytest.raises(SystemExit, match="on cpu"):  # GPU runs are not paired with a CPU call
        trl_side.load_trl_rewards(bench.parse_args(["--sides", "miles", "--trl-rewards", str(STORED)]), "cpu")


def test_a_stream_shifts_both_sides_seeds_and_pairs_with_its_own_trl_lines(tmp_path):
    lines = [
        {"side": "trl", "seed": 0, "rewards": [0.1] * 3},
        {"side": "trl", "seed": 0, "stream": 1, "rewards": [0.4] * 3},
    ]
    assert trl_side.load_trl_rewards(_args(tmp_path, lines), "cpu")[0]["rewards"] == [0.1] * 3
    assert trl_side.load_trl_rewards(_args(tmp_path, lines, stream=1), "cpu")[0]["rewards"] == [0.4] * 3
    with pytest.raises(SystemExit, match="stream 2"):
        trl_side.load_trl_rewards(_args(tmp_path, lines, stream=2), "cpu")
    args = bench.parse_args(["--stream", "1"])
    cmd = bench.miles_command(args, "m", tmp_path / "d.jsonl", tmp_path / "o", 3, "cpu")
    seeds = {cmd[i]: int(cmd[i + 1]) for i, a in enumerate(cmd) if a in ("--seed", "--rollout-seed")}
    assert seeds == {"--seed": 1234 + 3 + job.STREAM_STRIDE, "--rollout-seed": 42 + 3 + job.STREAM_STRIDE}


def test_pooling_averages_each_side_over_its_streams_and_pairs_seeds_both_sides_ran():
    lines = [
        {"side": "trl", "seed": 0, "rewards": [0.5] * 5},
        {"side": "trl", "seed": 0, "stream": 1, "rewards": [0.7] * 5},  # TRL's seed 0: 0.6
        {"side": "miles", "seed": 0, "rewards": [0.55] * 5},
        {"side": "trl", "seed": 1, "rewards": [0.4] * 5},
        {"side": "miles", "seed": 1, "rewards": [0.5] * 5},
        {"side": "miles", "seed": 2, "rewards": [0.9] * 5},  # no TRL line: left out
        {"variant": "x", "seed": 0, "rewards": [0.0] * 5},  # not a side's line
    ]
    pooled = stats.pooled_last5(lines)
    assert pooled["seeds"] == [0, 1] and pooled["streams"] == {"miles": 2, "trl": 3}
    assert pooled["reward_last5_diff"] == pytest.approx([-0.05, 0.1])
    assert pooled["reward_last5_diff_mean"] == pytest.approx(0.025)
    assert pooled["reward_last5_diff_ci95"] == pytest.approx(12.706 * 0.15 / 2**0.5 / 2**0.5, rel=1e-3)
    with pytest.raises(SystemExit, match="both sides"):
        stats.pooled_last5(lines[:3][:2])


def test_pool_refuses_the_flags_of_a_run(tmp_path, capsys):
    path = tmp_path / "lines.jsonl"
    path.write_text(json.dumps({"side": "trl", "seed": 0, "rewards": [0.5] * 5}) + "\n")
    path.write_text(path.read_text() + json.dumps({"side": "miles", "seed": 0, "rewards": [0.4] * 5}) + "\n")
    assert bench.main(["--pool", str(path)]) == 0
    assert json.loads(capsys.readouterr().out)["reward_last5_diff_mean"] == pytest.approx(-0.1)
    with pytest.raises(SystemExit, match="--seeds --stream would be ignored"):
        bench.main(["--pool", str(path), "--seeds", "3", "--stream", "1"])


def test_pool_keeps_one_device(tmp_path):
    path = tmp_path / "lines.jsonl"
    lines = [
        {"side": side, "seed": 0, "device": device, "rewards": [r] * 5}
        for side, device, r in [
            ("trl", "cuda", 0.5),
            ("miles", "cuda", 0.4),
            ("trl", "cpu", 0.1),
            ("miles", "cpu", 0.3),
        ]
    ]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    with pytest.raises(SystemExit, match=r"devices \['cpu', 'cuda'\]; pick one with --device"):
        bench.pool_lines(bench.parse_args(["--pool", str(path)]))
    kept = bench.pool_lines(bench.parse_args(["--pool", str(path), "--device", "cpu"]))
    assert stats.pooled_last5(kept)["reward_last5_diff_mean"] == pytest.approx(0.2)


def test_runs_that_shared_the_device_report_learning_only():
    args = bench.parse_args(["--steps", "3", "--seeds", "2"])
    run = {"steps": [1.0, 2.0, 3.0], "rewards": [0.1, 0.2, 0.3], "startup_s": 5.0, "startup_phases": {}}
    miles = [run | {"phases": {"generate": [1.0] * 3}, "command": "miles train"}] * 2
    trl = [run | {"phases": {"generate": [2.0] * 3}}] * 2
    line = stats.learning_fields(stats.summary(args, "cuda", miles, trl), 3)
    assert line["concurrent"] == 3 and line["reward_last5_diff"] == pytest.approx([0.0, 0.0])
    assert not [k for k in line if "step_s" in k or "startup" in k or "phases" in k or k == "ratio"]


def test_the_gsm_jobs_miles_side_trains_as_the_recipe_does(tmp_path):
    args = bench.parse_args(["--job", "gsm", "--steps", "3"])
    cmd = bench.miles_command(args, "m", tmp_path / "d.jsonl", tmp_path, 0, "cuda")
    assert cmd[cmd.index("--max-tokens-per-gpu") + 1] == "32768" and "--compile" in cmd
    assert "--compile" not in bench.miles_command(args, "m", tmp_path / "d.jsonl", tmp_path, 0, "cpu")


def test_a_longer_stored_run_is_compared_over_the_calls_steps(tmp_path):
    lines = [{"side": "trl", "seed": 0, "rewards": [0.1, 0.2, 0.3, 0.9, 0.9]}]
    assert trl_side.load_trl_rewards(_args(tmp_path, lines), "cpu")[0]["rewards"] == [0.1, 0.2, 0.3]


def test_a_trl_run_cut_short_keeps_the_steps_it_finished(tmp_path):
    out = tmp_path / "trl-0.json"
    with pytest.raises(SystemExit, match="no step within --timeout-s 5"):
        trl_side._cut_short(out, 0, 5.0)
    out.with_suffix(".partial.json").write_text(
        json.dumps({"rewards": [0.1, 0.3], "steps": [9.0, 8.0], "generate": [7.0, 6.0]})
    )
    run = trl_side._cut_short(out, 0, 5.0)
    assert run["cut_short"] and run["rewards"] == [0.1, 0.3] and run["startup_s"] is None
    assert bench._seed_line("trl", 0, 0, run)["cut_short"] is True
    miles = {"rewards": [0.2, 0.2, 0.2, 0.5]}
    assert stats.common_steps([miles, run]) == 2 and miles["rewards"] == [0.2, 0.2]
    line = stats.summary(
        bench.parse_args(["--steps", "4"]),
        "cpu",
        [
            miles
            | {
                "steps": [1.0] * 2,
                "startup_s": 3.0,
                "phases": {"generate": [0.5] * 2},
                "startup_phases": {},
                "command": "m",
            }
        ],
        [run],
    )
    assert line["reward_last5_diff"] == pytest.approx([0.2 - 0.2])
    assert line["trl_startup_s"] is None


def test_trls_continuous_batching_reaches_its_worker_and_its_seed_line(tmp_path, monkeypatch):
    specs = []

    def fake_run(cmd, **kw):  # the worker's process: read its spec, write its result
        spec = json.loads(open(cmd[-1]).read())
        specs.append(spec)
        assert cmd[1:3] == [str(trl_side.DRIVER), "--trl-worker"]  # the bench script again, as recorded runs did
        result = {"steps": [1.0], "rewards": [0.5], "startup_s": 1.0, "phases": {"generate": [0.5]}}
        open(spec["out"], "w").write(json.dumps(result | {"continuous_batching": spec["continuous_batching"]}))
        return trl_side.subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(trl_side.subprocess, "run", fake_run)
    for flag in ([], ["--trl-continuous-batching"]):
        args = bench.parse_args(["--sides", "trl", "--steps", "1", *flag])
        run = trl_side.run_trl(args, "model", tmp_path / "d.jsonl", tmp_path, 0, "cpu")
        assert specs[-1]["continuous_batching"] is bool(flag)
        assert bench._seed_line("trl", 0, 0, run).get("trl_continuous_batching", False) is bool(flag)
    assert trl_side.DRIVER == job.REPO / "bench/e2e_vs_trl.py"
    assert bench.parse_args(["--trl-worker", "spec.json"]).trl_worker == "spec.json"


def test_runs_sharing_the_gpu_split_the_paged_caches_share_of_memory(tmp_path, monkeypatch):
    pytest.importorskip("trl")
    specs = []

    def fake_run(cmd, **kw):
        specs.append(json.loads(open(cmd[-1]).read()))
        open(specs[-1]["out"], "w").write(json.dumps({"steps": [1.0], "rewards": [0.5], "startup_s": 1.0}))
        return trl_side.subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(trl_side.subprocess, "run", fake_run)
    for concurrent, share in ((1, 0.5), (3, 0.5 / 3)):
        flags = ["--sides", "trl", "--steps", "1", "--trl-continuous-batching", "--concurrent", str(concurrent)]
        trl_side.run_trl(bench.parse_args(flags), "model", tmp_path / "d.jsonl", tmp_path, 0, "cpu")
        config = trl_side._grpo_config(specs[-1] | {"out": str(tmp_path / "o.json")})
        assert config.use_transformers_continuous_batching
        assert config.transformers_continuous_batching_config == {"max_memory_percent": pytest.approx(share)}
    plain = trl_side._grpo_config(specs[-1] | {"continuous_batching": False, "out": str(tmp_path / "o.json")})
    assert not plain.use_transformers_continuous_batching and plain.transformers_continuous_batching_config is None


def test_trls_static_cache_reaches_its_config_and_its_seed_line(tmp_path, monkeypatch):
    trl = pytest.importorskip("trl")
    specs = []

    def fake_run(cmd, **kw):
        specs.append(json.loads(open(cmd[-1]).read()))
        result = {"steps": [1.0], "rewards": [0.5], "startup_s": 1.0, "static_cache": specs[-1]["static_cache"]}
        open(specs[-1]["out"], "w").write(json.dumps(result))
        return trl_side.subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(trl_side.subprocess, "run", fake_run)
    for flag in ([], ["--trl-static-cache"]):
        args = bench.parse_args(["--sides", "trl", "--steps", "1", *flag])
        run = trl_side.run_trl(args, "model", tmp_path / "d.jsonl", tmp_path, 0, "cpu")
        config = trl_side._grpo_config(specs[-1] | {"out": str(tmp_path / "o.json")})
        assert config.cache_implementation == ("static" if flag else None)
        default = trl.GRPOConfig(output_dir=str(tmp_path / "d"), use_cpu=True).pad_to_multiple_of  # TRL's own
        assert config.pad_to_multiple_of == (trl_side.STATIC_PROMPT_MULTIPLE if flag else default)
        assert not config.use_transformers_continuous_batching
        assert bench._seed_line("trl", 0, 0, run).get("trl_static_cache", False) is bool(flag)
    with pytest.raises(SystemExit):
        bench.parse_args(["--trl-static-cache", "--trl-continuous-batching"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--sides", "miles", "--trl-static-cache"])


def test_trls_continuous_batching_is_refused_where_no_trl_side_runs():
    with pytest.raises(SystemExit):
        bench.parse_args(["--sides", "miles", "--trl-continuous-batching"])
    with pytest.raises(SystemExit, match="--trl-continuous-batching would be ignored"):
        bench.pool_lines(bench.parse_args(["--pool", "x.jsonl", "--trl-continuous-batching"]))
