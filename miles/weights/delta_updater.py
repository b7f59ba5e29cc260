"""Trainer-side driver of disk-delta updates (files under `--update-weight-disk-dir`).

connect(): each engine host materialises its startup weights as its own local copy (before any
noise the equality check adds). First update: trainer rank 0 snapshots the base and publishes
only `base.json`; each engine checks its copy against it and reloads it. Later updates: rank 0
writes the version; every engine pulls (patch + verify its copy); only when *all* engines
accepted are they told to reload, so a refused version leaves every engine on the old weights.

Recovery: each pull answers with the version that host's copy holds, accepted or refused. A
host that refused no longer holds the base of the next delta, so while any host is behind the
next version is published as a full re-base (every tensor, applicable at any version) and every
engine reloads it. A refusal is reported in the metrics (`weight_sync/refused_engines`) and the
engines keep serving and reporting their old version; a host that refuses two updates in a row
(the re-base included) raises, naming it, instead of serving stale weights for ever. A refused
first update (the base) raises at once: there is no trainer version the engines could fall back on.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path

from miles.weights.base import EngineCallError, WeightUpdater
from miles.weights.bucket import NamedTensor
from miles.weights.disk_delta import DeltaPublisher
from miles.weights.receiver import MATERIALISE_BASE

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
        # The version each host's copy holds, as its last pull answered (None: not known).
        self.host_versions: list[int | None] = []
        self._refused_last: set[int] = set()

    def local_dir(self, i: int) -> str:
        """Engine i's host-local copy (a real deployment points this at each host's local disk)."""
        if self._local_dirs is not None:
            return self._local_dirs[i]
        return str(self.root / "hosts" / f"engine-{i:03d}")

    def _connect(self, master_address: str, master_port: int | None) -> None:
        pass

    def _probe_engines(self) -> None:
        super()._probe_engines()
        self._require_endpoint(
            "/pull_weights",
            "disk-delta patches each engine host's copy through /pull_weights, an endpoint of Miles' SGLang fork "
            "and of the embedded engine that vanilla SGLang does not have; use --update-weight-transfer-mode "
            "broadcast (or p2p) with vanilla SGLang",
        )

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
        self.host_versions = [None] * len(self.engines)

    def _transfer(self, named: Iterable[NamedTensor], version: int) -> dict[str, float]:
        if not self.is_leader:
            for _ in named:
                pass
            return {}
        first = self.publisher.version is None
        behind = [i for i, v in enumerate(self.host_versions) if v != self.publisher.version]
        full = not first and bool(behind)
        if full:
            logger.warning(
                "disk-delta v%d is a full re-base: engines %s do not hold v%s", version, behind, self.publisher.version
            )
        stats = self.publisher.publish(named, version, full=full)
        self.host_versions = [None] * len(self.engines)  # unknown until the hosts answer
        pulled, refused = self._pull(version)
        if first and refused:
            # the hosts' copies (the engines' startup weights) are not the trainer's base: a resumed
            # trainer. Publish the base itself in full once; every host can take that.
            logger.warning(
                "disk-delta base v%d differs from the engines' startup weights (a resume?); publishing it in full: %s",
                version,
                "; ".join(f"engine {i}: {why}" for i, why in sorted(refused.items())),
            )
            stats = self.publisher.republish_base_full()
            full = True
            pulled, refused = self._pull(version)
        for i, answer in pulled.items():
            self.host_versions[i] = answer.get("version")
        if refused:
            self._refuse(version, refused, first)
        else:
            self._run_engines(
                "update_weights_from_disk",
                lambda i: {
                    "model_path": self.local_dir(i),
                    "weight_version": str(version),
                },
            )
        self._refused_last = set(refused)
        fraction = stats.bytes_written / max(stats.model_bytes, 1)
        return {
            "weight_sync/delta_bytes_written": float(stats.bytes_written),
            "weight_sync/delta_bytes_fraction": fraction,
            "weight_sync/delta_changed_tensors": float(stats.changed_tensors),
            "weight_sync/delta_full": float(full),
            "weight_sync/refused_engines": float(len(refused)),
            "weight_sync/delta_bytes_read_per_engine": float(sum(p.get("bytes_read", 0) for p in pulled.values()))
            / max(len(pulled), 1),
        }

    def _pull(self, version: int) -> tuple[dict[int, dict], dict[int, str]]:
        """Every host patches its copy to `version`: (answers, {engine: why} of those that refused)."""
        pulled = self._run_engines(
            "pull_weights",
            lambda i: {
                "local_checkpoint_dir": self.local_dir(i),
                "source_dir": str(self.publisher.root),
                "target_version": version,
            },
        )
        return pulled, {i: a.get("message", "refused") for i, a in pulled.items() if a.get("refused")}

    def _refuse(self, version: int, refused: dict[int, str], first: bool) -> None:
        """No engine reloads; they keep serving (and reporting) the version they had."""
        detail = "; ".join(f"engine {i} ({self.engines[i]!r}): {why}" for i, why in sorted(refused.items()))
        again = sorted(set(refused) & self._refused_last)
        if first or again:
            what = "the disk-delta base" if first else f"two updates in a row (v{version} was a full re-base)"
            raise EngineCallError(
                f"pull_weights v{version}: engines {again or sorted(refused)} refused {what}; {detail}"
            )
        self.held_back = set(range(len(self.engines)))
        logger.warning(
            "disk-delta v%d refused, every engine keeps its old weights; the next update re-bases them: %s",
            version,
            detail,
        )
