"""One contract, two engines: every request miles sends, against SGLang's own HTTP layer and against the
embedded engine's front.

`sglang` is `sglang_standin`: SGLang 0.5.23's FastAPI app, request classes, API-key middleware and
model-runner weight path (`WeightUpdater`, `init_custom_process_group`, `MultiprocessingSerializer`)
over stand-in schedulers, one process per tensor-parallel rank; skipped when sglang is not installed
(`pip install -e '.[sglang-contract]' && pip install --no-deps sglang==0.5.23`, see docs/engines.md).
`embedded` is `miles engine serve` on a tiny model. Each test drives both with the same miles code
(EngineClient, the weight updaters, the rollout's payload builders) and checks what arrived: the
request objects SGLang decoded, and the bytes every engine rank holds afterwards. The SGLang engines
are one of one GPU and one of two (two TP ranks, so two ranks in every weight-sync group).
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from miles.config import WeightsConfig
from miles.controller.router import Router
from miles.engines.client import EngineClient, EngineHTTPError
from miles.engines.sglang_protocol import REQUEST_FIELDS, SGLANG_VERSION_CHECKED
from miles.testing.fake_engine import run_trainer_ranks
from miles.weights import verify
from miles.weights.base import EngineUnsupportedError
from miles.weights.broadcast import BroadcastUpdater
from miles.weights.colocated import ColocatedUpdater
from miles.weights.colocated_direct import DirectColocatedUpdater
from miles.weights.delta_updater import DiskDeltaUpdater
from miles.weights.p2p import P2PUpdater
from miles.wire.ports import free_port

sys.path.insert(0, str(Path(__file__).parent))
from sglang_standin import SGLANG_VERSION, StandInFleet, process_alive  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
KEY = "contract-key"
HAS_SGLANG = importlib.util.find_spec("sglang") is not None
NO_SGLANG = (
    "sglang is not installed: pip install -e '.[sglang-contract]' && pip install --no-deps "
    f"sglang=={SGLANG_VERSION} (and torchvision's CPU build; docs/engines.md)"
)


@dataclass
class Engines:
    """One kind of engine under test: two engines, the GPUs (TP ranks) of each, how to read what they hold."""

    kind: str
    urls: list[str]
    gpus: list[int]
    skip: str | None = None
    versions: list[int] = field(default_factory=list)

    def client(self, i: int) -> EngineClient:
        return EngineClient(self.urls[i], api_key=KEY, timeout_s=120, max_retries=0)


def _run(coro):
    return asyncio.run(coro)


async def _call(url: str, fn):
    async with EngineClient(url, api_key=KEY, timeout_s=120, max_retries=0) as client:
        return await fn(client)


def _records(url: str) -> list[dict]:
    return _run(_call(url, lambda c: c._get("/standin/records")))


def _start_embedded(model_dir: str, weight_dir: str) -> subprocess.Popen:
    code = "import sys; from miles.engines.http_front import serve_main; sys.exit(serve_main(sys.argv[1:]))"
    # the repository first, then the PYTHONPATH the tests run with (packages installed off site-packages)
    python_path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=python_path)
    args = ["--model-path", model_dir, "--port", "0", "--api-key", KEY, "--weight-dir", weight_dir]
    return subprocess.Popen(
        [sys.executable, "-c", code, *args], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env
    )


def _serving_url(proc: subprocess.Popen) -> str:
    line = proc.stdout.readline()
    match = re.search(r"on (http://\S+)", line)
    if not match:
        raise RuntimeError(f"miles engine serve did not start (exit {proc.poll()}): {line!r}")
    return match.group(1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from miles.models.tiny import make_tiny_model

    torch.set_num_threads(1)
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny")), layers=1, hidden=32, heads=2, kv_heads=1)


@pytest.fixture(scope="module")
def disk_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("disk"))


@pytest.fixture(scope="module")
def spec(model_dir) -> list[tuple[str, list[int], str]]:
    state = load_file(str(Path(model_dir) / "model.safetensors"))
    return [(n, list(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in sorted(state.items())]


@pytest.fixture(scope="module")
def fleets(model_dir, disk_dir, spec):
    """Both kinds at once: the SGLang import and the embedded engines' start-up overlap."""
    fleet = StandInFleet() if HAS_SGLANG else None
    procs = [_start_embedded(model_dir, disk_dir) for _ in range(2)]
    kinds = {}
    try:
        kinds["embedded"] = Engines("embedded", [_serving_url(p) for p in procs], [1, 1])
        if fleet is None:
            kinds["sglang"] = Engines("sglang", [], [], skip=NO_SGLANG)
        else:
            fleet.wait_ready()
            if fleet.skip_reason:
                kinds["sglang"] = Engines("sglang", [], [], skip=fleet.skip_reason)
            else:
                urls = [fleet.start_engine(spec, tp_size=k, seed=k, api_key=KEY) for k in (1, 2)]
                kinds["sglang"] = Engines("sglang", urls, [1, 2])
        yield kinds
    finally:
        for p in procs:
            p.terminate()
        pids = list(fleet.engine_pids) if fleet else []
        if fleet is not None:
            fleet.close()
        for p in procs:
            p.wait(timeout=60)
    assert not [pid for pid in pids if process_alive(pid)], "a stand-in SGLang engine outlived the fleet"


def _available(kind: Engines) -> Engines:
    """The kind, or a skip (a failure where CI installed SGLang: MILES_REQUIRE_SGLANG_CONTRACT=1)."""
    if kind.skip:
        if os.environ.get("MILES_REQUIRE_SGLANG_CONTRACT") == "1":
            pytest.fail(f"MILES_REQUIRE_SGLANG_CONTRACT=1 but {kind.skip}")
        pytest.skip(kind.skip)
    return kind


@pytest.fixture(params=["sglang", "embedded"])
def engines(request, fleets) -> Engines:
    return _available(fleets[request.param])


# -- what the engines hold ------------------------------------------------------------------------


def _version_tensors(spec, version: int) -> dict[str, torch.Tensor]:
    """The trainer's weights for `version`: the dtypes and shapes the engines serve, new values."""
    gen = torch.Generator().manual_seed(100 + version)
    return {n: torch.randn(s, generator=gen).to(getattr(torch, d)) for n, s, d in spec}


def _assert_engines_hold(engines: Engines, indices: list[int], tensors: dict[str, torch.Tensor], version: int) -> None:
    for i in indices:
        if engines.kind == "sglang":  # every TP rank of the engine, byte for byte
            dump = _run(_call(engines.urls[i], lambda c: c._get("/standin/dump")))
            want = {
                n: hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
                for n, t in tensors.items()
            }
            assert len(dump["ranks"]) == engines.gpus[i]
            for rank, held in enumerate(dump["ranks"]):
                assert held == want, f"engine {i} TP rank {rank} does not hold version {version}"
            assert dump["weight_version"] == str(version)
        else:
            digests = {n: verify.tensor_digest(t) for n, t in tensors.items()}
            result = _run(_call(engines.urls[i], lambda c, d=digests: c.weights_checker(action="compare", digests=d)))
            assert result["mismatched"] == [] and result["missing"] == [], result
            assert _run(_call(engines.urls[i], lambda c: c.get_weight_version())) == version


async def _close_all(clients: list[EngineClient]) -> None:
    await asyncio.gather(*(c.close() for c in clients))


def _push(engines: Engines, make, world: int, version: int, spec, indices: list[int] | None = None) -> dict:
    """`world` trainer ranks (threads) connect `make(cfg)` to the engines, push `version`, close; rank 0's metrics."""
    indices = list(range(len(engines.urls))) if indices is None else indices
    tensors = _version_tensors(spec, version)
    cfg = WeightsConfig(update_weight_buffer_size=3000, weight_sync_timeout_s=60)  # several buckets
    port = free_port()
    out = {}

    def rank(r: int, barrier) -> None:
        updater = make(cfg)
        clients = [engines.client(i) for i in indices]
        try:
            updater.connect(
                clients,
                trainer_rank=r,
                trainer_world_size=world,
                master_port=port,
                barrier=barrier,
                all_gather=barrier.all_gather,
            )
            metrics = updater.update(iter(tensors.items()), version)
            if r == 0:
                out.update(metrics)
        finally:
            if updater._loop is not None:  # the clients' sessions live on the updater's loop
                updater._run(_close_all(clients))
            updater.close()

    async def each(method: str, **kw) -> None:  # the controller pauses generation around every update
        await asyncio.gather(*(_call(engines.urls[i], lambda c: getattr(c, method)(**kw)) for i in indices))

    _run(each("pause_generation", mode="retract"))
    try:
        run_trainer_ranks(world, rank, timeout_s=180)
    finally:
        _run(each("continue_generation"))
    _assert_engines_hold(engines, indices, tensors, version)
    return out


def _classes(records: list[dict], cls: str) -> list[dict]:
    return [r["fields"] for r in records if r["class"] == cls]


# -- the tests ------------------------------------------------------------------------------------


def test_request_field_table_is_sglangs(fleets):
    """REQUEST_FIELDS (what the embedded front accepts) equals the fields of SGLang's own request classes."""
    kind = _available(fleets["sglang"])
    assert SGLANG_VERSION_CHECKED == SGLANG_VERSION
    routes = _run(_call(kind.urls[0], lambda c: c._get("/standin/fields")))
    for endpoint, fields in REQUEST_FIELDS.items():
        assert sorted(fields) == routes[f"/{endpoint}"][1], f"/{endpoint} ({routes[f'/{endpoint}'][0]})"


def test_rollout_payloads(engines, model_dir):
    """A rollout sample (miles.rollout.generate) and its log-prob re-scoring (GroupRunner.recompute)."""
    from transformers import AutoTokenizer

    from miles.config import MilesConfig
    from miles.controller.group_runner import GroupRunner
    from miles.rollout.generate import SamplingDefaults, generate_sample
    from miles.rollout.sample import Sample

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    sampling = SamplingDefaults(
        temperature=0.7,
        top_p=0.9,
        top_k=20,
        max_new_tokens=4,
        stop=("\n\n",),
        stop_token_ids=(tokenizer.eos_token_id,),
    )

    async def main():
        async with engines.client(0) as client:
            router = Router([client])
            sample = await generate_sample(router, Sample(prompt="What is 3+4?"), tokenizer, sampling, seed=5)
            cfg = MilesConfig()
            cfg.rollout.sglang_server_concurrency = 2
            await GroupRunner(cfg, router, tokenizer, sampling).recompute(sample)
        return sample

    sample = _run(main())
    assert 1 <= sample.response_length <= 4 and len(sample.rollout_log_probs) == sample.response_length
    if engines.kind == "sglang":
        rollout, rescore = _classes(_records(engines.urls[0]), "GenerateReqInput")[-2:]
        assert rollout["input_ids"] == sample.tokens[: sample.prompt_length] and rollout["return_logprob"]
        assert rollout["sampling_params"] == sampling.to_payload(sample.prompt_length, seed=5)
        assert rescore["input_ids"] == sample.tokens and rescore["logprob_start_len"] == sample.prompt_length
        assert rescore["sampling_params"]["max_new_tokens"] == 0


def test_control_payloads(engines):
    """Abort, pause (every mode) and continue, flush, memory release and resume, version, info, health."""
    tags = ["cuda_graph", "kv_cache", "weights"]

    async def main(c: EngineClient):
        await c.abort_request(rid="r-1")
        await c.abort_request(abort_all=True)
        for mode in ("abort", "retract", "in_place"):
            await c.pause_generation(mode)
            await c.continue_generation()
        flushed = await c.flush_cache()
        await c.release_memory_occupation(tags)
        await c.resume_memory_occupation(tags)
        await c.update_weight_version(7)
        return flushed, await c.get_weight_version(), await c.server_info(), await c.health(generate=True)

    flushed, version, info, healthy = _run(_call(engines.urls[1], main))
    assert flushed and version == 7 and healthy
    assert info["tp_size"] == engines.gpus[1]
    if engines.kind == "sglang":
        records = _records(engines.urls[1])
        aborts = _classes(records, "AbortReq")
        assert {"rid": "r-1", "abort_all": False} in aborts and {"rid": "", "abort_all": True} in aborts
        assert [r["mode"] for r in _classes(records, "PauseGenerationReqInput")] == ["abort", "retract", "in_place"]
        assert len(_classes(records, "ContinueGenerationReqInput")) == 3
        assert [r["tags"] for r in _classes(records, "ReleaseMemoryOccupationReqInput")] == [tags]
        assert [r["tags"] for r in _classes(records, "ResumeMemoryOccupationReqInput")] == [tags]
        assert _classes(records, "UpdateWeightVersionReqInput")[-1]["new_version"] == "7"


def test_broadcast_gives_every_engine_gpu_a_rank(engines, spec):
    _push(engines, BroadcastUpdater, world=1, version=11, spec=spec)
    if engines.kind == "sglang":  # engine 0 of 1 GPU holds rank 1, engine 1 of 2 GPUs ranks 2 and 3
        inits = [_classes(_records(u), "InitWeightsUpdateGroupReqInput")[-1] for u in engines.urls]
        assert [(r["rank_offset"], r["world_size"], r["group_name"]) for r in inits] == [
            (1, 4, "miles"),
            (2, 4, "miles"),
        ]
        bucket = _classes(_records(engines.urls[1]), "UpdateWeightsFromDistributedReqInput")[-1]
        assert bucket["weight_version"] == "11" and bucket["load_format"] is None and not bucket["flush_cache"]


def test_p2p_is_one_broadcast_group_per_source(engines, spec):
    _push(engines, P2PUpdater, world=2, version=12, spec=spec)
    if engines.kind == "sglang":  # source 0 -> engine 0 (group of 2), source 1 -> engine 1 (group of 1 + 2 GPUs)
        inits = [_classes(_records(u), "InitWeightsUpdateGroupReqInput")[-1] for u in engines.urls]
        assert [(r["rank_offset"], r["world_size"], r["group_name"]) for r in inits] == [
            (1, 2, "miles-p2p-0"),
            (1, 3, "miles-p2p-1"),
        ]


@pytest.mark.parametrize("updater_cls", [ColocatedUpdater, DirectColocatedUpdater])
def test_colocated(engines, spec, updater_cls):
    """SGLang's serialisation, one entry per TP rank from the trainer rank on that GPU; the direct path where the
    engine exports its weight buffer (embedded), SGLang's path where it does not (404)."""
    metrics = _push(engines, updater_cls, world=sum(engines.gpus), version=13, spec=spec)
    direct = updater_cls is DirectColocatedUpdater and engines.kind == "embedded"
    assert (metrics["weight_sync/buckets"] == 0) == direct
    if engines.kind == "sglang":
        entries = [
            len(r["serialized_named_tensors"])
            for r in _classes(_records(engines.urls[1]), "UpdateWeightsFromTensorReqInput")
        ]
        assert entries and set(entries) == {2}  # the engine of two GPUs gets two payloads per bucket


def test_disk_delta_needs_pull_weights(engines, spec, disk_dir):
    def make(cfg):
        cfg.update_weight_disk_dir = disk_dir
        return DiskDeltaUpdater(cfg)

    if engines.kind == "sglang":
        with pytest.raises(EngineUnsupportedError, match="do not serve /pull_weights"):
            _push(engines, make, world=1, version=14, spec=spec)
        assert not _classes(_records(engines.urls[0]), "UpdateWeightFromDiskReqInput")  # refused before any change
    else:
        _push(engines, make, world=1, version=14, spec=spec)


def test_disk_reload_payload(engines, model_dir):
    """What disk-delta posts after its pull: SGLang decodes it (its stand-in model loader does not load)."""
    body = {"model_path": model_dir, "weight_version": "15"}
    if engines.kind == "sglang":
        with pytest.raises(EngineHTTPError, match="validated and recorded"):
            _run(_call(engines.urls[0], lambda c: c.update_weights_from_disk(**body)))
        got = _classes(_records(engines.urls[0]), "UpdateWeightFromDiskReqInput")[-1]
        assert (got["model_path"], got["weight_version"]) == (model_dir, "15")
    else:
        _run(_call(engines.urls[0], lambda c: c.update_weights_from_disk(**body)))
        assert _run(_call(engines.urls[0], lambda c: c.get_weight_version())) == 15


def test_weight_check_needs_the_digest_checker(engines, spec):
    def make(cfg):
        cfg.check_weight_update_equal = True
        return BroadcastUpdater(cfg)

    if engines.kind == "sglang":
        with pytest.raises(EngineUnsupportedError, match="no digest weight checker"):
            _push(engines, make, world=1, version=16, spec=spec)
    else:
        _push(engines, make, world=1, version=16, spec=spec)


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"names": [], "dtypes": [], "shapes": [], "src_rank": 1}, "src_rank"),  # the old p2p field
        ({"names": [], "dtypes": [], "shapes": [], "weight_version": 3}, "weight_version"),  # a number, not a string
    ],
)
def test_fields_sglang_would_drop_or_refuse_are_400_on_both(engines, body, needle):
    with pytest.raises(EngineHTTPError, match=needle) as err:
        _run(_call(engines.urls[0], lambda c: c.update_weights_from_distributed(**body)))
    assert err.value.status in (400, 422)


@pytest.mark.parametrize("colocate", [False, True])
def test_lora_adapter_sync_needs_the_embedded_engine(engines, colocate):
    """Vanilla SGLang has no load_lora_adapter_from_distributed: both adapter paths are refused on connect."""
    from miles.weights.lora import make_lora_updater

    updater = make_lora_updater(WeightsConfig(weight_sync_timeout_s=60), colocate=colocate, adapter_config={"r": 2})
    clients = [engines.client(0)]
    try:
        if engines.kind == "sglang":
            with pytest.raises(EngineUnsupportedError, match="load_lora_adapter_from_distributed"):
                updater.connect(clients, master_port=free_port())
        else:
            updater.connect(clients, master_port=free_port())
    finally:
        if updater._loop is not None:
            updater._run(_close_all(clients))
        updater.close()
