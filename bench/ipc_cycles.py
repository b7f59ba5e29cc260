"""The direct colocated weight path's release cycle across two processes, at a size a leak would show.

An "engine" process packs `--mib` MiB into a fresh weight buffer (`SharedWeights.pack`, as its resume does) and
exports it; this process, the "trainer", maps the export (`MappedBuffer`, as `DirectColocatedUpdater` does),
writes into it and closes the mapping (`--mapping close`, the updater's rule when engines release their weights)
or keeps it until the next generation's export (`keep`); the engine then drops the buffer and gives its cached
memory back (`SharedWeights.drop`, `give_back_cached_memory`, as its release does). Each cycle prints the
engine's `torch.cuda.memory_allocated` after the release, the device's memory in use (all processes), and, on
CUDA, torch's cross-process reference count of the export (its slot in the engine's counter file, read as a
signed 64-bit integer) after the trainer closed its mapping. An
0.5B colocated run with offload on an H100 grew its engine by one weight push a step (bench/results/gsm.md, Run E).

The engine shares the buffer once per export for a mapping, and the trainer's close gives that count back
(miles/weights/arena.py). `--drop-count` makes the engine drop the count right after sharing, as it did before:
the side by side for what that did (the trainer's close took torch's unsigned counter below zero, and every buffer
released after one stayed in torch's IPC limbo).

    python bench/ipc_cycles.py --device cuda --mib 1024 --cycles 6 [--mapping keep] [--drop-count]
    python bench/ipc_cycles.py --device cpu --mib 8 --cycles 2     # the CPU smoke (shared memory, no count)

Ends with one JSON line: per cycle, the engine's allocated bytes, the device's used bytes and the count.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os

import numpy as np
import torch


def _engine(conn, device: str, nbytes: int, cycles: int, drop_count: bool) -> None:
    """The engine's side: pack, export, (the trainer writes), drop and give memory back; report after each."""
    from miles.utils.cuda_cache import give_back_cached_memory
    from miles.weights.arena import SharedWeights
    from miles.weights.tensor_ipc import unb64

    shared = SharedWeights(device)
    for cycle in range(cycles):
        views = shared.pack({"w": torch.full((nbytes,), cycle % 251, dtype=torch.uint8)})
        export = shared.export({"w": views["w"]}, None, None, for_mapping=True)
        if drop_count and export["buffer"]["kind"] == "cuda_ipc":  # the engine's protocol before
            torch.UntypedStorage._release_ipc_counter_cuda(  # noqa: SLF001
                unb64(export["buffer"]["ref_counter_handle"]), export["buffer"]["ref_counter_offset"]
            )
        conn.send(export)
        conn.recv()  # the trainer wrote (and closed its mapping, or kept it)
        written = bool((views["w"][:: max(1, nbytes // 4096)] == (cycle + 1) % 251).all())
        del views
        shared.drop()
        if device == "cuda":
            give_back_cached_memory()
            conn.send(
                {
                    "written": written,
                    "allocated": torch.cuda.memory_allocated(),
                    "reserved": torch.cuda.memory_reserved(),
                }
            )
        else:
            conn.send({"written": written, "allocated": None, "reserved": None})
    shared.close()


COUNTER_FILE_HEADER = 64  # bytes torch's RefcountedMapAllocator keeps before a counter file's data (its own count)


def read_count(export: dict) -> int | None:
    """The export's reference count in the engine's counter file (/dev/shm), as a signed 64-bit integer."""
    buffer = export["buffer"]
    if buffer["kind"] != "cuda_ipc":
        return None
    from miles.weights.tensor_ipc import unb64

    name = unb64(buffer["ref_counter_handle"]).decode().lstrip("/")
    try:
        counters = np.memmap(os.path.join("/dev/shm", name), dtype=np.int64, mode="r")
        return int(counters[COUNTER_FILE_HEADER // 8 + buffer["ref_counter_offset"]])
    except (OSError, IndexError, ValueError):  # not where torch's layout puts it: the memory figures still stand
        return None


def run(a: argparse.Namespace) -> list[dict]:
    from miles.weights.buffer_writer import MappedBuffer

    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_engine, args=(there, a.device, a.mib << 20, a.cycles, a.drop_count))
    proc.start()
    rows, kept = [], None
    try:
        for cycle in range(a.cycles):
            export = here.recv()
            if kept is not None:  # `keep`: the previous generation's mapping goes when the new one comes
                kept.close()
            mapped = MappedBuffer(export)
            payload = torch.full((a.mib << 20,), (cycle + 1) % 251, dtype=torch.uint8, device=a.device)
            mapped.writer.write([("w", payload)])
            if a.device == "cuda":
                torch.cuda.synchronize()
            kept = mapped if a.mapping == "keep" else None
            if kept is None:
                mapped.close()
            del mapped, payload
            count = read_count(export)
            here.send("written")
            engine = here.recv()
            used = None
            if a.device == "cuda":
                free, total = torch.cuda.mem_get_info()
                used = total - free
            rows.append({"cycle": cycle, **engine, "device_used": used, "count_after_close": count})
            if not engine["written"]:
                raise SystemExit(
                    f"ipc_cycles: cycle {cycle}: the engine's buffer does not hold what the trainer wrote"
                )
            print(
                f"cycle {cycle}: engine allocated {_gib(engine['allocated'])}, reserved {_gib(engine['reserved'])}; "
                f"device in use {_gib(used)}; the export's count after the trainer's close: {count}",
                flush=True,
            )
        if kept is not None:
            kept.close()
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.kill()
    return rows


def _gib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**30:.3f} GiB"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    p.add_argument("--mib", type=int, default=1024, help="the weight buffer's size")
    p.add_argument("--cycles", type=int, default=6)
    p.add_argument("--mapping", choices=("close", "keep"), default="close")
    p.add_argument("--drop-count", action="store_true", help="the engine drops its share's count at once (as before)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("ipc_cycles: --device cuda, but no CUDA device here; pass --device cpu for the smoke")
    rows = run(a)
    grow = None
    if rows and rows[0]["device_used"] is not None and len(rows) > 1:
        grow = (rows[-1]["device_used"] - rows[0]["device_used"]) / (len(rows) - 1) / (a.mib << 20)
        print(f"device memory in use grew {grow:.2f} buffers a cycle")
    print(json.dumps({"config": vars(a), "cycles": rows, "growth_in_buffers_per_cycle": grow}))


if __name__ == "__main__":
    main()
