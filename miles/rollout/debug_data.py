"""Saved rollouts for the debug modes (`--save-debug-rollout-data`, `--load-debug-rollout-data`).

One file per step, at the path template with `{rollout_id}` replaced by the step (and one per evaluation,
with `eval_<weight version>` in its place), as Miles writes them: `torch.save({"rollout_id": int, "samples": [Sample.to_dict(), ...]})`, plus `"metrics"` (the
step's rollout metrics, replayed into metrics.jsonl). Samples are in the order the trainer got
them: consecutive samples with one `group_index` form a group. Every value is a plain container,
string or number, so a file loads with `torch.load(weights_only=True)`: no pickle of arbitrary
objects, in either direction. Python floats are float64, so log-probs and rewards replay bit for bit.
"""

from __future__ import annotations

import os

from miles.rollout.sample import Sample

FORMAT_VERSION = 1


def debug_rollout_path(template: str, rollout_id: int | str) -> str:
    """The file of step `rollout_id`: `template` with `{rollout_id}` filled in (`eval_<version>` for an
    evaluation's samples)."""
    return template.format(rollout_id=rollout_id)


def save_debug_rollout(
    template: str, rollout_id: int | str, groups: list[list[Sample]], metrics: dict[str, float] | None = None
) -> str:
    """Write one step's groups; written beside the target, then renamed: a reader never sees half a file."""
    path = debug_rollout_path(template, rollout_id)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    payload = {
        "format_version": FORMAT_VERSION,
        "rollout_id": rollout_id,
        "samples": [s.to_dict() for g in groups for s in g],
        "metrics": {k: float(v) for k, v in (metrics or {}).items()},
    }
    tmp = f"{path}.tmp-{os.getpid()}"
    import torch  # here, not at import: the controller starts its workers without loading torch

    torch.save(payload, tmp)
    os.replace(tmp, path)
    return path


def load_debug_rollout(template: str, rollout_id: int) -> tuple[list[list[Sample]], dict[str, float]]:
    """Groups and rollout metrics of step `rollout_id`; FileNotFoundError names the flag and the path."""
    path = debug_rollout_path(template, rollout_id)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--load-debug-rollout-data: no saved rollout for step {rollout_id} at {path}")
    import torch

    payload = torch.load(path, weights_only=True)
    samples = [Sample.from_dict(d) for d in payload["samples"]]
    return group_consecutive(samples), dict(payload.get("metrics") or {})


def group_consecutive(samples: list[Sample]) -> list[list[Sample]]:
    """Split a flat list into groups: a new group starts wherever `group_index` changes."""
    groups: list[list[Sample]] = []
    for s in samples:
        if groups and groups[-1][0].group_index == s.group_index:
            groups[-1].append(s)
        else:
            groups.append([s])
    return groups
