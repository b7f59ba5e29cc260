"""Trainer-side driver of disk-delta updates (files under `--update-weight-disk-dir`).

connect(): each engine host materialises its startup weights as its own local copy (before any
noise the equality check adds). First update: trainer rank 0 snapshots the base and publishes
only `base.json`; each engine checks its copy against it and reloads it. Later updates: rank 0
writes the version; every engine pulls (patch + verify its copy); only when *all* engines
succeeded are they told to reload, so a refused version leaves every engine on the old weights.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from pathlib import Path

from miles.weights.bucket import NamedTensor
from miles.weights.disk_delta import DeltaPublisher
from miles.weights.receiver import MATERIALISE_BASE
from miles.weights.updater import WeightUpdater

logger = logging.getLogger(__name__)


class DiskDeltaUpdater(WeightUpdater):
    mode = "disk-delta"

    def __init__(self, *args, local_dirs: list[str] | None = None, **kw) -> None:
        super().__init__(*args, **kw)
        if not self.cfg.update_weight_disk_dir:
            raise ValueError("disk-delta needs --update-weight-disk-dir (a directory trainer and engine hosts share)")
        self.root = Path(self.cfg.update_weight_disk_dir)
        self.publisher = DeltaPublisher(self.root / "published", self.cfg.update_weight_delta_encoding, self.digest)
        self._local_dirs = local_dirs

    def local_dir(self, i: int) -> str:
        """Engine i's host-local copy (a real deployment points this at each host's local disk)."""
        if self._local_dirs is not None:
            return self._local_dirs[i]
        return str(self.root / "hosts" / f"engine-{i:03d}")

    def _connect(self, master_address: str, master_port: int | None) -> None:
        pass

    def _prepare_engines(self) -> None:
        # Host copies come from the engines' startup weights, before the equality check adds noise.
        self._run_engines(
            "pull_weights",
            lambda i: {
                "local_checkpoint_dir": self.local_dir(i),
                "source_dir": str(self.publisher.root),
                "target_version": MATERIALISE_BASE,
                "digest": self.digest,
            },
        )

    def _transfer(self, named: Iterable[NamedTensor], version: int) -> dict[str, float]:
        if not self.is_leader:
            for _ in named:
                pass
            return {}
        stats = self.publisher.publish(named, version)
        pulled = self._run_engines(
            "pull_weights",
            lambda i: {
                "local_checkpoint_dir": self.local_dir(i),
                "source_dir": str(self.publisher.root),
                "target_version": version,
            },
        )
        self._run_engines(
            "update_weights_from_disk",
            lambda i: {
                "model_path": self.local_dir(i),
                "weight_version": str(version),
            },
        )
        fraction = stats.bytes_written / max(stats.model_bytes, 1)
        return {
            "weight_sync/delta_bytes_written": float(stats.bytes_written),
            "weight_sync/delta_bytes_fraction": fraction,
            "weight_sync/delta_changed_tensors": float(stats.changed_tensors),
            "weight_sync/delta_bytes_read_per_engine": float(sum(p.get("bytes_read", 0) for p in pulled.values()))
            / max(len(pulled), 1),
        }


def published_size(root: str | Path, version: int) -> int:
    """Bytes on disk of one published version (its delta files and index)."""
    from miles.weights.disk_delta import version_dir

    d = version_dir(root, version)
    return sum(os.path.getsize(d / f) for f in os.listdir(d))
