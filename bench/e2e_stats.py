"""How `bench/e2e_vs_trl.py` reads its runs: step-time and phase medians, last-five rewards, miles' minus
TRL's reward seed by seed with a 95% t-interval, and the summary line of a call.
"""

from __future__ import annotations

import argparse
import re
import statistics

from e2e_job import max_new_tokens

TIMING_FIELD = re.compile(r"step_s|startup|phases|ratio")


def _median_after_first(runs: list[dict], key: str = "steps") -> float:
    values = [v for r in runs for v in r[key][1:]] or [v for r in runs for v in r[key]]
    return statistics.median(values)


def _phase_medians(runs: list[dict]) -> dict[str, float]:
    names = runs[0]["phases"]
    return {
        name: round(
            statistics.median(
                [v for r in runs for v in r["phases"][name][1:]] or [v for r in runs for v in r["phases"][name]]
            ),
            4,
        )
        for name in names
    }


def common_steps(runs: list[dict]) -> int:
    """Cut every run's rewards to the steps all of them finished (some were cut short by --timeout-s), so
    that the last-five figures of both sides come from the same steps; returns that count."""
    steps = min(len(r["rewards"]) for r in runs)
    for r in runs:
        r["rewards"] = r["rewards"][:steps]
    return steps


def _mean_known(values) -> float | None:
    """The mean of the values that are not None (a run cut short has no start-up figure), None if none is."""
    known = [v for v in values if v is not None]
    return round(statistics.fmean(known), 2) if known else None


def last5(runs: list[dict]) -> float:
    """Each run's mean reward over its last five steps, averaged over the runs."""
    return round(statistics.fmean(statistics.fmean(r["rewards"][-5:]) for r in runs), 4)


# Student's t at 0.975 for 1-10 degrees of freedom; above, z + (z^3 + z) / (4 df) (within 0.01 of it).
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)


def t975(df: int) -> float:
    return _T975[df - 1] if df <= len(_T975) else 1.96 + (1.96**3 + 1.96) / (4 * df)


def half_width(values: list[float]) -> float | None:
    """The half-width of the 95% t-interval of the mean of `values` (None with fewer than two)."""
    return t975(len(values) - 1) * statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else None


def paired_last5(miles: list[dict], trl: list[dict]) -> dict:
    """miles' minus TRL's last-five reward seed by seed (both sides took the same prompts), their mean
    and the half-width of its 95% t-interval (None with one seed): whether a gap is more than noise."""
    return _diff_fields(
        [
            statistics.fmean(m["rewards"][-5:]) - statistics.fmean(t["rewards"][-5:])
            for m, t in zip(miles, trl, strict=True)
        ]
    )


def _diff_fields(diffs: list[float]) -> dict:
    """Per-seed differences, their mean and the half-width of its 95% t-interval (None with one seed)."""
    half = half_width(diffs)
    return {
        "reward_last5_diff": [round(d, 4) for d in diffs],
        "reward_last5_diff_mean": round(statistics.fmean(diffs), 4),
        "reward_last5_diff_ci95": None if half is None else round(half, 4),
    }


def pooled_last5(lines: list[dict]) -> dict:
    """Per-seed lines of both sides (any streams) -> miles' minus TRL's last-five reward for every seed that
    both sides ran, each side's value the mean over its streams of that seed; their mean and 95% t-interval."""
    by: dict[tuple[str, int], list[float]] = {}
    for d in lines:
        if d.get("side") in ("miles", "trl"):
            by.setdefault((d["side"], d["seed"]), []).append(statistics.fmean(d["rewards"][-5:]))
    seeds = sorted(k for side, k in by if side == "miles" and ("trl", k) in by)
    if not seeds:
        raise SystemExit("--pool: no seed has lines of both sides")
    per_seed = {side: [statistics.fmean(by[side, k]) for k in seeds] for side in ("miles", "trl")}
    return {
        "seeds": seeds,
        "streams": {side: sum(len(by[side, k]) for k in seeds) for side in per_seed},
        "miles_reward_last5": round(statistics.fmean(per_seed["miles"]), 4),
        "trl_reward_last5": round(statistics.fmean(per_seed["trl"]), 4),
    } | _diff_fields([m - t for m, t in zip(per_seed["miles"], per_seed["trl"], strict=True)])


def summary(args: argparse.Namespace, device: str, miles: list[dict], trl: list[dict]) -> dict:
    line: dict = {
        "job": args.job,
        "device": device,
        "steps": args.steps,
        "seeds": list(range(args.first_seed, args.first_seed + args.seeds)),
        "stream": args.stream,
        "batch": f"{args.prompts}x{args.samples}",
        "max_new_tokens": max_new_tokens(args),
    }
    if miles:
        line |= {
            "miles_step_s": round(_median_after_first(miles), 4),
            "miles_startup_s": round(statistics.fmean(r["startup_s"] for r in miles), 2),
            "miles_reward_last5": last5(miles),
            "miles_phases": _phase_medians(miles),
            "miles_startup_phases": miles[0]["startup_phases"],
            "miles_command": miles[0]["command"],
        }
    if trl:
        line |= {
            "trl_step_s": round(_median_after_first(trl), 4),
            "trl_startup_s": _mean_known(r["startup_s"] for r in trl),
            "trl_reward_last5": last5(trl),
            "trl_phases": _phase_medians(trl),
        }
    if miles and trl:
        line["ratio"] = round(line["miles_step_s"] / line["trl_step_s"], 3)
        line |= paired_last5(miles, trl)
    return line


def learning_fields(line: dict, concurrent: int) -> dict:
    """A summary of runs that shared the device: their times say nothing about either side alone."""
    return {k: v for k, v in line.items() if not TIMING_FIELD.search(k)} | {"concurrent": concurrent}
