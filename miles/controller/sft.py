"""The rollout side of an SFT run (`--loss-type sft_loss`), behind the sync loop's `generate(rollout_id)`.

Nothing is generated: each step takes the next `--rollout-batch-size` rows of --prompt-data, which
the supervised data path (miles/rollout/sft_data.py) tokenised at start-up with their loss masks.
No engine is started (the placement plans none) and weight pushes have no receiver, so the loop
is: take rows -> train -> save/export.
"""

from __future__ import annotations

from miles.controller.rollout_manager import RolloutResult
from miles.rollout.data_source import DataSource


class SupervisedRollouts:
    def __init__(self, source: DataSource, rows_per_step: int) -> None:
        self.source = source
        self.rows_per_step = rows_per_step

    async def generate(self, rollout_id: int) -> RolloutResult:
        groups = self.source.get_samples(self.rows_per_step)
        samples = [s for g in groups for s in g]
        trained = [sum(s.loss_mask or []) for s in samples]
        metrics = {
            "sft/samples": float(len(samples)),
            "sft/tokens_mean": sum(len(s.tokens) for s in samples) / max(len(samples), 1),
            "sft/trained_tokens_mean": sum(trained) / max(len(samples), 1),
            "sft/epoch": float(getattr(self.source, "epoch", 0)),
        }
        return RolloutResult(groups=groups, metrics=metrics)
