"""Disk-delta weight updates: publish only changed bytes as numbered versions on shared storage.

Trainer side (`DeltaPublisher`): the first update snapshots a host copy of every tensor as the
base and publishes only `base.json` (per-tensor digests, no tensor bytes). Each later update
compares the new tensors with the snapshot and writes `v{version:08d}/` holding one
zstd-compressed delta per changed tensor, then `index.json` last (temp file, fsync, rename):
a reader sees a version only once all of it is on disk. `publish(..., full=True)` writes a
re-base instead: every tensor's new bytes, applicable to a copy at any version (the trainer
uses it for hosts that refused a version and so no longer hold the delta's base).

Engine side (`LocalCheckpoint`, `pull_version`): each engine host keeps its own copy of the
weights (one raw file per tensor plus a local index). A pull patches the changed tensors in
memory, checks the digest of every resulting tensor against the index, and only then commits
(new files, then the local index by rename). A wrong base, a missing or corrupt file, or a digest
failure raises `DeltaRefusedError` before anything changes, so the engine keeps serving the old
version. Encodings: `xor` (bytewise difference; applies exactly once, against its base),
`overwrite` (changed positions and new values; idempotent) and `full` (the re-base: whole
tensors, no base; idempotent).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import zstandard

from miles.weights.groups import dtype_from_name, dtype_name
from miles.weights.verify import check_digest_name, digest_bytes, tensor_bytes

logger = logging.getLogger(__name__)

ENCODINGS = ("xor", "overwrite")  # what --update-weight-delta-encoding may choose
FULL = "full"  # the re-base encoding: whole tensors, applies to a copy at any version
INDEX = "index.json"
BASE = "base.json"
FORMAT = "miles-disk-delta/1"


class DeltaRefusedError(RuntimeError):
    """A version cannot be applied to this host's copy; the copy and the engine are unchanged."""


def version_dir(root: str | Path, version: int) -> Path:
    return Path(root) / f"v{version:08d}"


def atomic_write(path: Path, data: bytes) -> None:
    """Write to a temp file in the same directory, fsync, rename over `path`, fsync the directory."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


# -- encodings ----------------------------------------------------------------------------------


def encode_delta(old: np.ndarray, new: np.ndarray, encoding: str, level: int = 3) -> bytes | None:
    """Compressed delta turning `old` bytes into `new` bytes; None when they are equal."""
    if old.shape != new.shape:
        raise ValueError(f"delta needs equal byte lengths, got {old.size} and {new.size}")
    if encoding == "xor":
        diff = np.bitwise_xor(old, new)
        if not diff.any():
            return None
        raw = diff.tobytes()
    elif encoding == "overwrite":
        positions = np.flatnonzero(old != new)
        if positions.size == 0:
            return None
        # Gaps between changed positions are small and repetitive, so they compress far better.
        gaps = np.diff(positions, prepend=0).astype(np.uint64)
        raw = np.uint64(positions.size).tobytes() + gaps.tobytes() + new[positions].tobytes()
    else:
        raise ValueError(f"unknown delta encoding {encoding!r}; use one of {ENCODINGS}")
    return zstandard.ZstdCompressor(level=level).compress(raw)


def apply_delta(buf: np.ndarray, payload: bytes, encoding: str) -> None:
    """Patch `buf` (writable uint8) in place; raises ValueError on a malformed payload."""
    try:
        raw = zstandard.ZstdDecompressor().decompress(payload, max_output_size=max(16 * buf.size + 16, 1 << 20))
    except zstandard.ZstdError as exc:
        raise ValueError(f"delta payload does not decompress: {exc}") from exc
    if encoding in ("xor", FULL):
        if len(raw) != buf.size:
            raise ValueError(f"{encoding} delta has {len(raw)} bytes, tensor has {buf.size}")
        if encoding == FULL:
            buf[:] = np.frombuffer(raw, dtype=np.uint8)
        else:
            np.bitwise_xor(buf, np.frombuffer(raw, dtype=np.uint8), out=buf)
    elif encoding == "overwrite":
        if len(raw) < 8:
            raise ValueError("overwrite delta is truncated")
        count = int(np.frombuffer(raw[:8], dtype=np.uint64)[0])
        if len(raw) != 8 + 9 * count:
            raise ValueError(f"overwrite delta declares {count} positions but holds {len(raw)} bytes")
        positions = np.cumsum(np.frombuffer(raw[8 : 8 + 8 * count], dtype=np.uint64))
        if count and int(positions[-1]) >= buf.size:
            raise ValueError(
                f"overwrite delta writes position {int(positions[-1])} past the tensor's {buf.size} bytes"
            )
        buf[positions.astype(np.int64)] = np.frombuffer(raw[8 + 8 * count :], dtype=np.uint8)
    else:
        raise ValueError(f"unknown delta encoding {encoding!r}; use one of {(*ENCODINGS, FULL)}")


# -- trainer side -------------------------------------------------------------------------------


@dataclass(slots=True)
class _Held:
    data: np.ndarray
    dtype: str
    shape: list[int]
    digest: str


@dataclass(slots=True)
class PublishStats:
    version: int
    base_version: int | None
    tensors: int
    changed_tensors: int
    model_bytes: int
    bytes_written: int


class DeltaPublisher:
    """Trainer-side writer of disk-delta versions under `root_dir` (run it on one rank only)."""

    def __init__(self, root_dir: str | Path, encoding: str = "xor", digest: str = "xxh3-128", level: int = 3) -> None:
        if encoding not in ENCODINGS:
            raise ValueError(f"update_weight_delta_encoding={encoding!r}; use one of {ENCODINGS}")
        self.root = Path(root_dir)
        self.encoding = encoding
        self.digest = check_digest_name(digest)
        self.level = level
        self._held: dict[str, _Held] = {}
        self.version: int | None = None

    def publish(self, named: Iterable[tuple[str, torch.Tensor]], version: int, *, full: bool = False) -> PublishStats:
        """Snapshot the base on the first call; later calls write version `version` against the previous one,
        or, with `full`, as a re-base that a host copy at any version can apply."""
        self.root.mkdir(parents=True, exist_ok=True)
        if self.version is None:
            return self._snapshot_base(named, version)
        if version <= self.version:
            raise ValueError(f"disk-delta version {version} is not after the last published version {self.version}")
        return self._write_version(named, version, full)

    def republish_base_full(self) -> PublishStats:
        """Publish the base version itself in full, for hosts whose copy is not the base: engines that
        restarted from the original checkpoint while the trainer resumed from a later one."""
        if self.version is None:
            raise ValueError("no disk-delta base yet: the first publish snapshots it")
        named = [
            (n, torch.from_numpy(h.data.copy()).view(dtype_from_name(h.dtype)).reshape(h.shape))
            for n, h in self._held.items()
        ]
        return self._write_version(named, self.version, full=True)

    def _snapshot_base(self, named: Iterable[tuple[str, torch.Tensor]], version: int) -> PublishStats:
        # versions of an earlier base (a run before a restart) can never apply again: clear them, so
        # their numbers can be published anew
        stale = sorted(p for p in self.root.glob("v[0-9]*") if p.is_dir())
        for path in stale:
            shutil.rmtree(path)
        if stale:
            logger.info("disk-delta: removed %d versions of an earlier base under %s", len(stale), self.root)
        held = {}
        for name, t in named:
            data = tensor_bytes(t).copy()
            held[name] = _Held(data, dtype_name(t.dtype), list(t.shape), digest_bytes(data, self.digest))
        index = {
            "format": FORMAT,
            "version": version,
            "digest": self.digest,
            "tensors": {n: {"dtype": h.dtype, "shape": h.shape, "digest": h.digest} for n, h in held.items()},
        }
        atomic_write(self.root / BASE, json.dumps(index).encode())
        self._held, self.version = held, version
        total = sum(h.data.size for h in held.values())
        logger.info("disk-delta base v%d: %d tensors, %.1f MB held on the host", version, len(held), total / 1e6)
        return PublishStats(version, None, len(held), 0, total, 0)

    def _write_version(self, named: Iterable[tuple[str, torch.Tensor]], version: int, full: bool) -> PublishStats:
        out = self._fresh_version_dir(version)
        encoding = FULL if full else self.encoding
        entries, updated, written, total = {}, {}, 0, 0
        for i, (name, t) in enumerate(named):
            entry, held, size, nbytes = self._write_tensor(out, f"t{i:05d}.zst", name, t, encoding)
            total += size
            written += nbytes
            if held is not None:
                updated[name] = held
            entries[name] = entry
        if set(entries) != set(self._held):
            raise ValueError(
                f"version {version} lacks tensors of the base: {sorted(set(self._held) - set(entries))[:8]}"
            )
        index = {
            "format": FORMAT,
            "version": version,
            "base_version": None if full else self.version,
            "encoding": encoding,
            "digest": self.digest,
            "compression": "zstd",
            "tensors": entries,
        }
        atomic_write(out / INDEX, json.dumps(index).encode())  # last: the version becomes visible here
        base_version = self.version
        self._held.update(updated)
        self.version = version
        logger.info(
            "disk-delta v%d (%s): %d/%d tensors written, %.2f MB",
            version,
            "full re-base" if full else f"base v{base_version}",
            len(updated),
            len(entries),
            written / 1e6,
        )
        return PublishStats(version, None if full else base_version, len(entries), len(updated), total, written)

    def _fresh_version_dir(self, version: int) -> Path:
        """The empty directory of `version`; refused if that version was already published."""
        out = version_dir(self.root, version)
        if (out / INDEX).exists():
            raise ValueError(f"disk-delta version {version} already exists at {out}; versions are immutable")
        if out.exists():  # a half-written attempt: it was never visible (no index), so it can go
            shutil.rmtree(out)
        out.mkdir(parents=True)
        return out

    def _write_tensor(
        self, out: Path, fname: str, name: str, t: torch.Tensor, encoding: str
    ) -> tuple[dict, _Held | None, int, int]:
        """Write one tensor's delta (or, with the `full` encoding, its bytes) to `out/fname` if it changed.

        Returns (index entry, the new held copy or None when unchanged, model bytes, bytes written)."""
        prev = self._held.get(name)
        new = tensor_bytes(t)
        if prev is None or prev.data.size != new.size or prev.dtype != dtype_name(t.dtype):
            raise ValueError(
                f"tensor {name!r} ({dtype_name(t.dtype)}, {list(t.shape)}) does not match the disk-delta base; "
                "names, dtypes and shapes must stay fixed across versions"
            )
        if encoding == FULL:
            payload = zstandard.ZstdCompressor(level=self.level).compress(new.tobytes())
        else:
            payload = encode_delta(prev.data, new, encoding, self.level)
        entry = {
            "dtype": prev.dtype,
            "shape": prev.shape,
            "nbytes": int(new.size),
            "file": None,
            "digest": prev.digest,
        }
        if payload is None:
            return entry, None, int(new.size), 0
        atomic_write(out / fname, payload)
        data = new.copy()
        held = _Held(data, prev.dtype, prev.shape, digest_bytes(data, self.digest))
        entry.update(file=fname, digest=held.digest)
        return entry, held, int(new.size), len(payload)


# -- engine host side ----------------------------------------------------------------------------


class LocalCheckpoint:
    """An engine host's own copy of the weights: raw tensor files plus `index.json` committed by rename."""

    def __init__(self, local_dir: str | Path) -> None:
        self.dir = Path(local_dir)

    def exists(self) -> bool:
        return (self.dir / INDEX).exists()

    def read_index(self) -> dict:
        try:
            return json.loads((self.dir / INDEX).read_text())
        except FileNotFoundError as exc:
            raise DeltaRefusedError(f"no local checkpoint at {self.dir}; materialise the base first") from exc

    def materialise(self, named: Iterable[tuple[str, torch.Tensor]], version: int, digest: str) -> dict:
        """Write every tensor as the local copy (used once, from the engine's startup weights)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for i, (name, t) in enumerate(named):
            data = tensor_bytes(t)
            fname = f"t{i:05d}.v{version}.bin"
            atomic_write(self.dir / fname, data.tobytes())
            tensors[name] = {
                "dtype": dtype_name(t.dtype),
                "shape": list(t.shape),
                "file": fname,
                "digest": digest_bytes(data, digest),
            }
        index = {"format": FORMAT, "version": version, "digest": digest, "tensors": tensors}
        atomic_write(self.dir / INDEX, json.dumps(index).encode())
        return index

    def read_tensor_bytes(self, entry: dict) -> np.ndarray:
        return np.fromfile(self.dir / entry["file"], dtype=np.uint8)

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, entry in self.read_index()["tensors"].items():
            data = torch.from_numpy(self.read_tensor_bytes(entry))
            yield name, data.view(dtype_from_name(entry["dtype"])).reshape(entry["shape"])

    def set_version(self, version: int) -> None:
        index = self.read_index()
        index["version"] = version
        atomic_write(self.dir / INDEX, json.dumps(index).encode())


def adopt_base(local: LocalCheckpoint, source_dir: str | Path, target_version: int) -> dict:
    """Check the host copy against the trainer's `base.json` and label it with the base version."""
    try:
        base = json.loads((Path(source_dir) / BASE).read_text())
    except (FileNotFoundError, json.JSONDecodeError) as exc:
        raise DeltaRefusedError(f"no readable {BASE} under {source_dir}: {exc}") from exc
    if base.get("version") != target_version:
        raise DeltaRefusedError(
            f"{BASE} under {source_dir} is version {base.get('version')}, asked for {target_version}"
        )
    index = local.read_index()
    if index["digest"] != base["digest"]:
        raise DeltaRefusedError(f"local copy uses digest {index['digest']}, the trainer's base {base['digest']}")
    differ = [n for n, e in base["tensors"].items() if index["tensors"].get(n, {}).get("digest") != e["digest"]]
    if differ:
        raise DeltaRefusedError(
            f"this engine's startup weights differ from the trainer's base v{target_version} in {len(differ)} tensors "
            f"(first: {differ[:4]}); disk-delta needs every engine to start from the trainer's checkpoint"
        )
    local.set_version(target_version)
    return {"version": target_version, "changed_tensors": 0, "bytes_read": 0}


def is_full_version(source_dir: str | Path, version: int) -> bool:
    """Whether `version` is published as a full re-base (False when it is not published or unreadable)."""
    try:
        return json.loads((version_dir(source_dir, version) / INDEX).read_text()).get("encoding") == FULL
    except (OSError, json.JSONDecodeError):
        return False


def pull_version(local: LocalCheckpoint, source_dir: str | Path, target_version: int) -> dict:
    """Patch the host copy to `target_version`, verify every digest, then commit. Raises DeltaRefusedError."""
    src = version_dir(source_dir, target_version)
    try:
        index = json.loads((src / INDEX).read_text())
    except FileNotFoundError as exc:
        raise DeltaRefusedError(
            f"version {target_version} is not published: {src / INDEX} is missing (not written yet or half-written)"
        ) from exc
    except json.JSONDecodeError as exc:
        raise DeltaRefusedError(f"{src / INDEX} is not valid JSON: {exc}") from exc
    mine = local.read_index()
    encoding, base_version = index["encoding"], index["base_version"]
    if index["version"] != target_version:
        raise DeltaRefusedError(f"{src / INDEX} says version {index['version']}, asked for {target_version}")
    if encoding != FULL:  # a re-base carries whole tensors, so it applies to a copy at any version
        if mine["version"] == target_version and encoding == "xor":
            raise DeltaRefusedError(
                f"version {target_version} is already applied here; an xor delta applies exactly once "
                "(re-applying undoes it)"
            )
        if mine["version"] != base_version and not (encoding == "overwrite" and mine["version"] == target_version):
            raise DeltaRefusedError(
                f"version {target_version} applies to base v{base_version}, but this host holds v{mine['version']}"
            )
    if set(index["tensors"]) != set(mine["tensors"]) or index["digest"] != mine["digest"]:
        raise DeltaRefusedError(
            f"version {target_version} does not describe the same tensors/digest as the local copy"
        )
    patched, bytes_read = {}, 0
    for name, entry in index["tensors"].items():
        if entry["file"] is None:
            if mine["tensors"][name]["digest"] != entry["digest"]:
                raise DeltaRefusedError(f"tensor {name!r}: unchanged in v{target_version} but the local copy differs")
            continue
        try:
            payload = (src / entry["file"]).read_bytes()
        except FileNotFoundError as exc:
            raise DeltaRefusedError(f"tensor {name!r}: delta file {src / entry['file']} is missing") from exc
        bytes_read += len(payload)
        buf = local.read_tensor_bytes(mine["tensors"][name])
        try:
            apply_delta(buf, payload, encoding)
        except ValueError as exc:
            raise DeltaRefusedError(f"tensor {name!r}: delta file {entry['file']} is corrupt: {exc}") from exc
        if digest_bytes(buf, index["digest"]) != entry["digest"]:
            raise DeltaRefusedError(
                f"tensor {name!r}: {index['digest']} digest of the patched tensor does not match v{target_version}'s index"
            )
        patched[name] = buf
    _commit(local, mine, index, patched, target_version)
    return {"version": target_version, "changed_tensors": len(patched), "bytes_read": bytes_read}


def _commit(local: LocalCheckpoint, mine: dict, index: dict, patched: dict[str, np.ndarray], version: int) -> None:
    # New files first under versioned names; the local index rename is the commit point.
    old_files = []
    for name, buf in patched.items():
        entry = mine["tensors"][name]
        fname = f"{entry['file'].split('.')[0]}.v{version}.bin"
        if fname != entry["file"]:
            old_files.append(entry["file"])
        atomic_write(local.dir / fname, buf.tobytes())
        entry.update(file=fname, digest=index["tensors"][name]["digest"])
    mine["version"] = version
    atomic_write(local.dir / INDEX, json.dumps(mine).encode())
    for fname in old_files:
        (local.dir / fname).unlink(missing_ok=True)
