"""What a run's evaluations answered, from the samples `--dump-details` (or `--save-debug-rollout-data`) saves.

    python bench/eval_dump.py DIR                    # DIR holds eval_<weight version>.pt (DIR/rollout_data)
    python bench/eval_dump.py DIR --set gsm_heldout  # one evaluation set only

For each saved evaluation (weight version) and set: accuracy, the share truncated, the share with no marked
final answer (no `\\boxed{}`, "the answer is" or `#### N`: a formatting failure rather than a wrong number),
and the mean response length. With a `template` in the samples' metadata (the GSM-symbolic data), it then
compares the first and the last evaluation template by template: how many templates gained, lost or stayed, and
the largest moves, which tells a gain spread over the held-out problem structures from one carried by a few.

Each later evaluation's gain over the first is taken question by question (the same questions, matched by
their index in the set) with two 95% intervals: over questions (paired t) and over templates (each template's
mean change one observation). The second is the one to read when the questions are variants of a few
templates: variants of one template succeed or fail together, so 500 questions from 20 templates hold far
fewer independent observations than 500. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from collections import defaultdict
from pathlib import Path

from e2e_stats import half_width

from miles.rollout.rm_hub.math_utils import extract_answer_phrase, extract_boxed, extract_hash_answer

EVAL_FILE = re.compile(r"^eval_(\d+)\.pt$")


def load_evals(directory: Path) -> dict[int, list[dict]]:
    """Weight version -> the saved samples (plain dicts) of that evaluation."""
    import torch

    found = {}
    for path in sorted(directory.iterdir()):
        m = EVAL_FILE.match(path.name)
        if m:
            found[int(m.group(1))] = torch.load(path, weights_only=True)["samples"]
    if not found:
        raise SystemExit(f"{directory}: no eval_<version>.pt files (run with --dump-details DIR)")
    return dict(sorted(found.items()))


def _reward(sample: dict) -> float:
    r = sample.get("reward")
    return float(r.get("reward", 0.0) if isinstance(r, dict) else r or 0.0)


def _marked(text: str) -> bool:
    return any(f(text) is not None for f in (extract_boxed, extract_answer_phrase, extract_hash_answer))


def figures(samples: list[dict]) -> dict:
    """Accuracy, truncated share, share without a marked answer, mean response length (tokens)."""
    return {
        "n": len(samples),
        "accuracy": round(statistics.fmean(_reward(s) for s in samples), 4),
        "truncated": round(statistics.fmean(s.get("status") == "truncated" for s in samples), 4),
        "unmarked": round(statistics.fmean(not _marked(s.get("response", "")) for s in samples), 4),
        "response_len": round(statistics.fmean(s.get("response_length", 0) for s in samples), 1),
    }


def by_template(samples: list[dict]) -> dict[str, float]:
    groups: dict[str, list[float]] = defaultdict(list)
    for s in samples:
        template = (s.get("metadata") or {}).get("template")
        if template is not None:
            groups[str(template)].append(_reward(s))
    return {t: statistics.fmean(v) for t, v in groups.items()}


def compare_templates(first: list[dict], last: list[dict], top: int) -> dict | None:
    """Template by template, the last evaluation's accuracy minus the first's (None without templates)."""
    a, b = by_template(first), by_template(last)
    common = sorted(set(a) & set(b))
    if not common:
        return None
    moves = sorted(((round(b[t] - a[t], 4), t) for t in common), reverse=True)
    return {
        "templates": len(common),
        "gained": sum(d > 0 for d, _ in moves),
        "lost": sum(d < 0 for d, _ in moves),
        "unchanged": sum(d == 0 for d, _ in moves),
        "largest_gains": [{"template": t, "change": d} for d, t in moves[:top] if d > 0],
        "largest_losses": [{"template": t, "change": d} for d, t in reversed(moves[-top:]) if d < 0],
    }


def gain(first: list[dict], last: list[dict]) -> dict | None:
    """The last evaluation's accuracy minus the first's on the questions both hold (matched by their index in
    the set), with the half-widths of its 95% intervals over questions and, with templates, over templates;
    None with fewer than two common questions."""
    a = {s.get("index"): s for s in first if s.get("index") is not None}
    b = {s.get("index"): s for s in last if s.get("index") is not None}
    common = sorted(set(a) & set(b))
    if len(common) < 2:
        return None
    changes = [_reward(b[i]) - _reward(a[i]) for i in common]
    out = {
        "questions": len(common),
        "gain": round(statistics.fmean(changes), 4),
        "ci95_questions": round(half_width(changes), 4),
    }
    groups: dict[str, list[float]] = defaultdict(list)
    for i, c in zip(common, changes, strict=True):
        template = (a[i].get("metadata") or {}).get("template")
        if template is not None:
            groups[str(template)].append(c)
    if len(groups) > 1:
        per_template = [statistics.fmean(v) for v in groups.values()]
        out["templates"] = len(groups)
        out["ci95_templates"] = round(half_width(per_template), 4)
    return out


def summarize(evals: dict[int, list[dict]], only: str | None, top: int) -> dict:
    sets: dict[str, dict[int, list[dict]]] = defaultdict(dict)
    for version, samples in evals.items():
        for s in samples:
            name = (s.get("metadata") or {}).get("eval_dataset", "eval")
            if only is None or name == only:
                sets[name].setdefault(version, []).append(s)
    out = {}
    for name, per_version in sorted(sets.items()):
        versions = sorted(per_version)
        out[name] = {
            "by_version": {v: figures(per_version[v]) for v in versions},
            "templates": compare_templates(per_version[versions[0]], per_version[versions[-1]], top)
            if len(versions) > 1
            else None,
            "gains": {v: gain(per_version[versions[0]], per_version[v]) for v in versions[1:]},
        }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", help="the directory of eval_<version>.pt files (DIR/rollout_data of --dump-details)")
    p.add_argument("--set", default=None, help="one evaluation set (its name in --eval-prompt-data)")
    p.add_argument("--top", type=int, default=5, help="templates listed among the largest moves")
    args = p.parse_args(argv)
    directory = Path(args.dir)
    if (directory / "rollout_data").is_dir():
        directory = directory / "rollout_data"
    out = summarize(load_evals(directory), args.set, args.top)
    for name, s in out.items():
        for version, f in s["by_version"].items():
            print(
                f"{name:14s} version {version:4d}  accuracy {f['accuracy']:.3f}  truncated {f['truncated']:.3f}  "
                f"no marked answer {f['unmarked']:.3f}  response {f['response_len']:.0f} tokens  (n={f['n']})"
            )
        for version, g in s["gains"].items():
            if g is None:
                continue
            over_templates = (
                f", +-{g['ci95_templates']:.3f} over {g['templates']} templates" if "templates" in g else ""
            )
            print(
                f"{name:14s} version {version:4d}  gain over version {min(s['by_version'])}: {g['gain']:+.3f} "
                f"(95%: +-{g['ci95_questions']:.3f} over {g['questions']} questions{over_templates})"
            )
        t = s["templates"]
        if t:
            print(
                f"{name:14s} templates, first -> last: {t['gained']} gained, {t['lost']} lost, {t['unchanged']} same"
            )
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
