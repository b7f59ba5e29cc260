"""Weight-sync benchmark: seconds per update and GB/s per transport, against a raw broadcast.

    python bench/weight_sync.py --params 20e6 --engines 2 --reps 3
    python bench/weight_sync.py --params 50e6 --reps 5   # on a GPU machine: adds the colocated update

For a synthetic bf16 model of --params parameters served by --engines fake engine processes:
- broadcast: BroadcastUpdater.update vs a bare ProcessGroup broadcast of the same bytes to the
  same engine processes' ranks (the raw baseline, same run, same gloo transport): ratio;
- p2p: one trainer rank (thread) per engine, each sending to its own engine;
- disk-delta: one real AdamW step at lr 1e-6 on fp32 masters, cast to bf16, then the update;
  bytes written / full model bytes;
- colocated (CUDA only): the update of a Qwen2-1.5B-sized bf16 model (1.54e9 parameters, built
  as named tensors) to an engine process on the same GPU, against the device's copy bandwidth
  measured in the same run (one device-to-device `copy_` of the same bytes, CUDA events).
  Two paths: `colocated_direct_*`, the trainer writing straight into the engine's shared weight
  buffer (`colocated_direct_s`: the whole `update()` with the buffer kept mapped between updates:
  generation check, copies, install call answered once the copies are done;
  `colocated_direct_fresh_s`: the same when the engine reallocated its buffer before every update,
  adding the export, IPC open and unmap), and `colocated_*`, the per-bucket handoff SGLang engines
  still get (whole `update()`).
  `--colocated-only` skips the gloo transports (about a minute on one H200).
Medians over --reps; ends with one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import threading
import time

import torch

from miles.config import WeightsConfig
from miles.engines.client import EngineClient
from miles.testing.fake_engine import FakeEngine, HTTPEngineControl, run_trainer_ranks, spawn_engines
from miles.weights.broadcast import BroadcastUpdater
from miles.weights.buffer_writer import BufferWriter
from miles.weights.colocated import ColocatedUpdater
from miles.weights.colocated_direct import DirectColocatedUpdater
from miles.weights.delta_updater import DiskDeltaUpdater
from miles.weights.groups import create_sync_group
from miles.weights.p2p import P2PUpdater
from miles.wire.ports import free_port


def model_spec(params: float, hidden: int = 1024) -> list[tuple[str, list[int], str]]:
    """Transformer-shaped tensors (attention, MLP, norms) adding up to about `params` parameters."""
    per_layer = 4 * hidden * hidden + 3 * hidden * 4 * hidden + 2 * hidden
    layers = max(1, int(params // per_layer))
    spec = [("model.embed_tokens.weight", [8192, hidden], "bfloat16")]
    for i in range(layers):
        p = f"model.layers.{i}."
        spec += [(p + f"self_attn.{n}_proj.weight", [hidden, hidden], "bfloat16") for n in "qkvo"]
        spec += [
            (p + "mlp.gate_proj.weight", [4 * hidden, hidden], "bfloat16"),
            (p + "mlp.up_proj.weight", [4 * hidden, hidden], "bfloat16"),
            (p + "mlp.down_proj.weight", [hidden, 4 * hidden], "bfloat16"),
            (p + "input_layernorm.weight", [hidden], "bfloat16"),
            (p + "post_attention_layernorm.weight", [hidden], "bfloat16"),
        ]
    return spec + [("model.norm.weight", [hidden], "bfloat16")]


def nbytes_of(spec) -> int:
    return sum(torch.Size(s).numel() * 2 for _, s, _ in spec)


def _stream(master: dict[str, torch.Tensor]):
    for n, t in master.items():
        yield n, t.to(torch.bfloat16)


def _timed(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_raw_broadcast(engines, nbytes: int, reps: int) -> float:
    """Bare broadcast of one flat buffer of the model's bytes to every engine process (their receivers join)."""
    port = free_port()
    world = 1 + len(engines)
    fut_loop = asyncio.new_event_loop()
    t = threading.Thread(target=fut_loop.run_forever, daemon=True)
    t.start()

    async def join() -> None:
        await asyncio.gather(
            *(
                e.init_weights_update_group(
                    master_address="127.0.0.1",
                    master_port=port,
                    rank_offset=1 + i,
                    world_size=world,
                    group_name="raw",
                    backend="gloo",
                )
                for i, e in enumerate(engines)
            )
        )

    joined = asyncio.run_coroutine_threadsafe(join(), fut_loop)
    group = create_sync_group("gloo", "127.0.0.1", port, world, 0, "raw", 300)
    joined.result(60)
    buf = torch.empty(nbytes // 2, dtype=torch.bfloat16)
    spec = {"names": ["raw"], "dtypes": ["bfloat16"], "shapes": [[nbytes // 2]], "group_name": "raw"}

    def once() -> None:
        # The engines post their receive through the same endpoint, but store nothing: `raw` is unknown
        # to them, so they answer an error after receiving; only the broadcast itself is timed here.
        async def post() -> None:
            await asyncio.gather(*(e.update_weights_from_distributed(**spec) for e in engines), return_exceptions=True)

        futs = asyncio.run_coroutine_threadsafe(post(), fut_loop)
        for w in group.broadcast([buf], 0):
            group.wait(w, "raw broadcast")
        futs.result(300)

    seconds = _timed(once, reps)
    group.destroy()
    fut_loop.call_soon_threadsafe(fut_loop.stop)
    return seconds


def bench_updater(make, engines, master, reps: int, ranks: int = 1) -> float:
    """Median seconds per update (versions 1..reps) with `ranks` trainer ranks as threads."""
    port = free_port()
    times: list[float] = []

    def rank(r: int, barrier) -> None:
        up = make()
        try:
            up.connect(engines, trainer_rank=r, trainer_world_size=ranks, master_port=port, barrier=barrier)
            for v in range(1, reps + 1):
                m = up.update(_stream(master), v)
                if r == 0:
                    times.append(m["weight_sync/seconds"])
        finally:
            up.close()

    run_trainer_ranks(ranks, rank, timeout_s=3600)
    return statistics.median(times)


def bench_disk_delta(engines, master, seed: int, reps: int) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as tmp:
        cfg = WeightsConfig(update_weight_transfer_mode="disk-delta", update_weight_disk_dir=tmp)
        up = DiskDeltaUpdater(cfg)
        up.connect(engines)
        up.update(_stream(master), 1)  # base snapshot
        params = {n: torch.nn.Parameter(t.float()) for n, t in master.items()}
        opt = torch.optim.AdamW(params.values(), lr=1e-6, weight_decay=0.0)
        gen = torch.Generator().manual_seed(seed)
        times, fractions = [], []
        for v in range(2, reps + 2):
            opt.zero_grad()
            loss = sum((p * torch.randn(p.shape, generator=gen)).sum() for p in params.values())
            loss.backward()
            opt.step()
            m = up.update(((n, p.detach().to(torch.bfloat16)) for n, p in params.items()), v)
            times.append(m["weight_sync/seconds"])
            fractions.append(m["weight_sync/delta_bytes_fraction"])
        up.close()
    return statistics.median(times), fractions[0]


def qwen2_1p5b_spec() -> list[tuple[str, list[int], str]]:
    """Qwen2-1.5B's tensors in bf16 (28 layers, hidden 1536, 2 KV heads, MLP 8960, tied embeddings): 1.54e9 params."""
    hidden, kv, mlp, vocab = 1536, 256, 8960, 151936
    spec = [("model.embed_tokens.weight", [vocab, hidden], "bfloat16")]
    for i in range(28):
        p = f"model.layers.{i}."
        spec += [
            (p + "self_attn.q_proj.weight", [hidden, hidden], "bfloat16"),
            (p + "self_attn.q_proj.bias", [hidden], "bfloat16"),
            (p + "self_attn.k_proj.weight", [kv, hidden], "bfloat16"),
            (p + "self_attn.k_proj.bias", [kv], "bfloat16"),
            (p + "self_attn.v_proj.weight", [kv, hidden], "bfloat16"),
            (p + "self_attn.v_proj.bias", [kv], "bfloat16"),
            (p + "self_attn.o_proj.weight", [hidden, hidden], "bfloat16"),
            (p + "mlp.gate_proj.weight", [mlp, hidden], "bfloat16"),
            (p + "mlp.up_proj.weight", [mlp, hidden], "bfloat16"),
            (p + "mlp.down_proj.weight", [hidden, mlp], "bfloat16"),
            (p + "input_layernorm.weight", [hidden], "bfloat16"),
            (p + "post_attention_layernorm.weight", [hidden], "bfloat16"),
        ]
    return spec + [("model.norm.weight", [hidden], "bfloat16")]


def bench_device_copy(nbytes: int, reps: int) -> float:
    """Median seconds of one device-to-device `copy_` of `nbytes`, timed with CUDA events."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _colocated_updates(engine: HTTPEngineControl, master, bucket_bytes: int, reps: int) -> tuple[float, float]:
    """Median (seconds per update, trainer-side packing seconds) over `reps` updates after a warm-up one."""
    up = ColocatedUpdater(WeightsConfig(update_weight_buffer_size=bucket_bytes, weight_sync_timeout_s=600))
    up.connect([engine])
    times, pack_times = [], []
    try:
        for v in range(1, reps + 2):
            # A trainer hands over freshly gathered tensors every update, not the same storages again.
            fresh = {n: t.clone() for n, t in master.items()}
            torch.cuda.synchronize()
            m = up.update(fresh.items(), v)
            times.append(m["weight_sync/seconds"])
            pack_times.append(m["weight_sync/pack_seconds"])
            del fresh
    finally:
        up.close()
    return statistics.median(times[1:]), statistics.median(pack_times[1:])  # [0] paid one-time CUDA/IPC set-up


def _direct_updates(url: str, master, reps: int, *, fresh_buffer: bool = False) -> dict[str, float]:
    """Medians (seconds) of direct colocated updates: the whole `update()` and its phases.

    Steady state (`fresh_buffer=False`): the trainer keeps the engine's buffer mapped between updates.
    `fresh_buffer=True`: the engine reallocates its buffer before every update (what a release and
    resume of its weights does), so each update maps the new buffer and unmaps it at the end."""
    control = HTTPEngineControl(url, timeout_s=600)
    up = DirectColocatedUpdater(WeightsConfig(weight_sync_timeout_s=600), keep_mapping=not fresh_buffer)
    up.connect([EngineClient(url, timeout_s=600)])  # pooled HTTP session, as in a real run
    keys = {
        "update": "weight_sync/seconds",
        "export": "weight_sync/direct_export_seconds",
        "map": "weight_sync/direct_map_seconds",
        "issue": "weight_sync/direct_issue_seconds",
        "copy_to_install": "weight_sync/direct_seconds",
        "unmap": "weight_sync/direct_unmap_seconds",
    }
    samples: dict[str, list[float]] = {k: [] for k in keys}
    try:
        for v in range(1, reps + 2):
            fresh = {n: t.clone() for n, t in master.items()}  # a trainer hands over fresh tensors each time
            if fresh_buffer and v > 1:
                asyncio.run(control.repack())
            torch.cuda.synchronize()
            m = up.update(fresh.items(), v)
            for k, key in keys.items():
                samples[k].append(m[key])
            if not fresh_buffer:  # the GPU time of the copies alone (CUDA events), into the kept mapping
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                up._mapped.writer.write(fresh.items())  # the same bytes again: the engine's state is unchanged
                end.record()
                end.synchronize()
                samples.setdefault("gpu_copies", []).append(start.elapsed_time(end) / 1e3)
            del fresh
    finally:
        up.close()
    return {k: statistics.median(x[1:]) for k, x in samples.items()}  # [0] packed the engine's buffer


def _phases(label: str, d: dict[str, float]) -> None:
    gpu = f"; the copies alone take {d['gpu_copies'] * 1e3:.2f} on the GPU" if "gpu_copies" in d else ""
    print(
        f"direct update, {label} (median ms): whole update {d['update'] * 1e3:.2f} = export/check "
        f"{d['export'] * 1e3:.2f} + map {d['map'] * 1e3:.2f} + first copy -> install answered "
        f"{d['copy_to_install'] * 1e3:.2f} (host issuing copies {d['issue'] * 1e3:.2f}) + unmap "
        f"{d['unmap'] * 1e3:.2f}{gpu}",
        flush=True,
    )


def bench_colocated(reps: int, bucket_bytes: int) -> dict:
    """The colocated update of a Qwen2-1.5B-sized bf16 model to an engine process on this GPU, vs the device copy."""
    spec = qwen2_1p5b_spec()
    nbytes = nbytes_of(spec)
    [proc] = spawn_engines(spec, 1, device="cuda", seeds=[1])
    try:
        engine = HTTPEngineControl(proc.url, timeout_s=600)
        master = FakeEngine(spec, device="cuda", seed=2).tensors
        copy_s = bench_device_copy(nbytes, max(reps, 5))
        steady = _direct_updates(proc.url, master, reps)
        _phases("buffer kept mapped", steady)
        fresh = _direct_updates(proc.url, master, reps, fresh_buffer=True)
        _phases("new buffer every update", fresh)
        variants = {}
        BufferWriter.LARGE_COPY_BYTES = 16 << 20  # variant: a memcpy of its own for every tensor >= 16 MiB
        try:
            variants["memcpy >= 16 MiB"] = _direct_updates(proc.url, master, reps)
        finally:
            BufferWriter.LARGE_COPY_BYTES = None
        _phases("buffer kept mapped, memcpy >= 16 MiB", variants["memcpy >= 16 MiB"])
        seconds, pack_s = _colocated_updates(engine, master, bucket_bytes, reps)
        one_bucket_s, _ = _colocated_updates(engine, master, nbytes, reps)  # how much the per-bucket calls cost
        copy_after = bench_device_copy(nbytes, max(reps, 5))  # the copy again: the GPU did not change clocks
        print(f"device copy: {copy_s * 1e3:.3f} ms before, {copy_after * 1e3:.3f} ms after the updates", flush=True)
        copy_s = min(copy_s, copy_after)
        return {
            "colocated_model_bytes": nbytes,
            "colocated_s": seconds,
            "colocated_GBps": nbytes / seconds / 1e9,
            "colocated_pack_s": pack_s,
            "colocated_one_bucket_s": one_bucket_s,
            "copy_s": copy_s,
            "copy_GBps": nbytes / copy_s / 1e9,
            "colocated_copy_fraction": copy_s / seconds,
            "colocated_direct_s": steady["update"],
            "colocated_direct_GBps": nbytes / steady["update"] / 1e9,
            "colocated_direct_copy_fraction": copy_s / steady["update"],
            "colocated_direct_phases_s": steady,
            "colocated_direct_fresh_s": fresh["update"],
            "colocated_direct_fresh_copy_fraction": copy_s / fresh["update"],
            "colocated_direct_fresh_phases_s": fresh,
            "colocated_direct_variants_s": {k: v["update"] for k, v in variants.items()},
        }
    finally:
        proc.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=float, default=20e6)
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--bucket-mb", type=int, default=512)
    ap.add_argument("--colocated-only", action="store_true", help="only the colocated figures (needs CUDA)")
    args = ap.parse_args()
    if args.colocated_only:
        col = bench_colocated(args.reps, args.bucket_mb * 1024**2)
        _print_colocated(col)
        print(json.dumps({**col, "device": torch.cuda.get_device_name()}))
        return
    spec = model_spec(args.params)
    nbytes = nbytes_of(spec)
    print(f"model: {len(spec)} tensors, {nbytes / 1e9:.3f} GB bf16; {args.engines} engines", flush=True)
    # std 0.02: the usual LLM init scale, which decides how many bf16 values one small step changes.
    procs = spawn_engines(spec, args.engines, seeds=[7] * args.engines, std=0.02)
    try:
        engines = [HTTPEngineControl(p.url, timeout_s=600) for p in procs]
        master = FakeEngine(spec, seed=7, std=0.02).tensors
        cfg = WeightsConfig(update_weight_buffer_size=args.bucket_mb * 1024**2, weight_sync_timeout_s=600)
        raw_s = bench_raw_broadcast(engines, nbytes, args.reps)
        bc_s = bench_updater(lambda: BroadcastUpdater(cfg, backend="gloo"), engines, master, args.reps)
        p2p_s = bench_updater(lambda: P2PUpdater(cfg, backend="gloo"), engines, master, args.reps, ranks=args.engines)
        for e in engines:
            asyncio.run(e.reset(seed=7))
        dd_s, dd_fraction = bench_disk_delta(engines, master, 0, args.reps)
    finally:
        for p in procs:
            p.stop()
    for name, s in (("raw broadcast", raw_s), ("broadcast", bc_s), ("p2p", p2p_s), ("disk-delta", dd_s)):
        print(f"{name:>14}: {s:.3f} s/update, {nbytes / s / 1e9:.3f} GB/s", flush=True)
    print(
        f"broadcast / raw = {bc_s / raw_s:.3f} (target <= 1.25); disk-delta bytes = {dd_fraction:.4f} of full "
        "(target <= 0.15)",
        flush=True,
    )
    result = {
        "model_bytes": nbytes,
        "broadcast_s": bc_s,
        "raw_broadcast_s": raw_s,
        "broadcast_ratio": bc_s / raw_s,
        "p2p_s": p2p_s,
        "disk_delta_s": dd_s,
        "disk_delta_bytes_fraction": dd_fraction,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    }
    if torch.cuda.is_available():
        col = bench_colocated(args.reps, args.bucket_mb * 1024**2)
        _print_colocated(col)
        result.update(col)
    print(json.dumps(result))


def _print_colocated(col: dict) -> None:
    gb = col["colocated_model_bytes"] / 1e9
    print(
        f"colocated direct: whole update {col['colocated_direct_s'] * 1e3:.2f} ms for {gb:.2f} GB = "
        f"{col['colocated_direct_GBps']:.0f} GB/s; device copy {col['copy_s'] * 1e3:.2f} ms = {col['copy_GBps']:.0f} GB/s;"
        f" direct / copy = {col['colocated_direct_copy_fraction']:.3f} (target >= 0.5). With a new engine buffer every "
        f"update: {col['colocated_direct_fresh_s'] * 1e3:.2f} ms = {col['colocated_direct_fresh_copy_fraction']:.3f}"
        f" of copy; variants: {', '.join(f'{k} {v * 1e3:.2f} ms' for k, v in col['colocated_direct_variants_s'].items())}",
        flush=True,
    )
    print(
        f"colocated per-bucket: {col['colocated_s'] * 1e3:.1f} ms = {col['colocated_GBps']:.0f} GB/s (trainer-side "
        f"packing {col['colocated_pack_s'] * 1e3:.1f} ms; {col['colocated_one_bucket_s'] * 1e3:.1f} ms as one "
        f"bucket); per-bucket / copy = {col['colocated_copy_fraction']:.3f}",
        flush=True,
    )


if __name__ == "__main__":
    main()
