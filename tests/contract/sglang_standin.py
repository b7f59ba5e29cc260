"""A stand-in SGLang server for the contract tests: SGLang's own HTTP layer over stand-in schedulers.

What is SGLang's own code here (sglang==0.5.23, imported on a CPU torch):
- the FastAPI app of `sglang.srt.entrypoints.http_server` with its routes, its request classes
  (`io_struct`), its body decoding, its `/generate` contract gate and its API-key middleware;
- per tensor-parallel rank, a process running SGLang's `WeightUpdater` (the model runner's weight
  path): `init_weights_update_group` through SGLang's `init_custom_process_group` with rank
  `rank_offset + tp_rank`, `receive_weights_from_distributed` (one broadcast per tensor from group
  rank 0), `update_weights_from_tensor` after `MultiprocessingSerializer.deserialize` of the rank's
  own entry (as `tp_worker.deserialize_own_rank` does);
- `GenerateReqInput.normalize_batch_and_arguments` and `SamplingParams(**params).normalize/verify`
  on every `/generate` body.

What stands in: the TokenizerManager (it records every request object the routes hand it, fans
weight requests out to the TP processes and answers `/generate` from a counter), the model (a
module holding named tensors), the runtime context `/model_info` reads, and `ServerArgs` for
`/server_info` (`tp_size`, `dp_size`, `pp_size`). One strictness SGLang lacks is added in front:
a body field the route's request class does not have is a 400 (SGLang would drop it silently;
a field it drops is a field the sender believed did something).

Processes: `StandInFleet` spawns one zygote that imports SGLang once (the slow part); each engine
is forked from it with its TP processes forked from the engine, all in the engine's own session,
killed by group when the engine stops or the fleet closes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import multiprocessing as mp
import os
import signal
import socket
import sys
import threading
import time
import types
import typing
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

SGLANG_VERSION = "0.5.23"
TensorSpec = list[tuple[str, list[int], str]]  # (HF name, shape, dtype name)


def import_sglang() -> str:
    """Import SGLang's HTTP server on this (CPU) torch; returns sglang's version.

    torchvision's CPU build matches a CPU torch. Where only its CUDA build can be had (download.pytorch.org
    unreachable), it is installed apart, in the directory `MILES_SGLANG_CONTRACT_SITE` names, and only this
    process puts it on its path: installed beside a CPU torch it would break `import torchvision`, and with
    it transformers' model imports, everywhere. Its C++ ops cannot load there and its fake-kernel
    registrations for them fail at import; SGLang only needs its Python transforms on this path, so those
    two registration modules are skipped."""
    site = os.environ.get("MILES_SGLANG_CONTRACT_SITE")
    if site and site not in sys.path:
        sys.path.append(site)
    try:
        import torchvision  # noqa: F401
    except RuntimeError:  # the CUDA build on a CPU torch: "operator torchvision::nms does not exist"
        for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
            del sys.modules[name]
        for name in ("torchvision._meta_registrations", "torchvision._autograd_registrations"):
            sys.modules[name] = types.ModuleType(name)
        import torchvision  # noqa: F401
    import sglang
    from sglang.srt.entrypoints import http_server  # noqa: F401

    return sglang.__version__


# -- TP rank processes ----------------------------------------------------------------------------


def _model(spec: TensorSpec, seed: int) -> Any:
    import torch

    class StandInModel(torch.nn.Module):
        """What SGLang's WeightUpdater asks of a model: load_weights, modules(), weight_cache_mode."""

        weight_cache_mode = "off"

        def __init__(self) -> None:
            super().__init__()
            gen = torch.Generator().manual_seed(seed)
            self.tensors = {n: torch.randn(s, generator=gen).to(getattr(torch, d)) for n, s, d in spec}

        def load_weights(self, named: Any) -> None:
            for name, t in named:
                dst = self.tensors.get(name)
                if dst is None or tuple(dst.shape) != tuple(t.shape) or dst.dtype != t.dtype:
                    raise ValueError(f"stand-in model has no {name} of {tuple(t.shape)} {t.dtype}")
                dst.copy_(t)

    return StandInModel()


def _tp_rank_main(conn: Any, tp_rank: int, spec: TensorSpec, seed: int) -> None:
    import torch
    import torch.distributed as dist
    from sglang.srt.model_executor.model_runner_components import weight_updater as wu
    from sglang.srt.utils.common import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # the TP rank's own world
    model = _model(spec, seed)
    wu.get_model = lambda: model  # the runtime context a real model runner publishes
    wu.get_parallel = lambda: types.SimpleNamespace(tp_rank=tp_rank)
    updater = wu.WeightUpdater(
        tp_rank=tp_rank,
        device="cpu",
        gpu_id=0,
        model_config=None,
        custom_weight_loaders={},
        get_model=lambda: model,
        update_model_fields=lambda *a, **k: None,
        recapture_cuda_graph=lambda: None,
        get_model_runner=lambda: None,
    )

    def update_tensor(serialized: list[bytes], load_format: str | None) -> tuple[bool, str]:
        monkey_patch_torch_reductions()  # tp_worker.deserialize_own_rank
        named = MultiprocessingSerializer.deserialize(serialized[tp_rank])
        return updater.update_weights_from_tensor(named, load_format)

    def update_distributed(**kw: Any) -> tuple[bool, str]:
        return updater.load_weights_from_distributed(updater.receive_weights_from_distributed(**kw))

    def dump() -> dict[str, str]:
        return {
            n: hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
            for n, t in model.tensors.items()
        }

    ops = {
        "init_group": updater.init_weights_update_group,
        "destroy_group": updater.destroy_weights_update_group,
        "update_distributed": update_distributed,
        "update_tensor": update_tensor,
        "dump": dump,
    }
    while True:
        try:
            op, kw = conn.recv()
        except EOFError:
            return
        try:
            conn.send(("ok", ops[op](**kw)))
        except Exception as exc:  # noqa: BLE001 - reported to the engine, which answers the request with it
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


# -- the engine: SGLang's app over a stand-in TokenizerManager -------------------------------------


# What SamplingParams.normalize asks of a tokenizer: the length of a stop string in tokens (here: bytes).
_BYTE_TOKENIZER = types.SimpleNamespace(encode=lambda text, add_special_tokens=False: list(text.encode()))


class _ServerArgs:
    """ServerArgs as /server_info reads it: the parallel sizes; every other setting unset (None)."""

    launch_command = "stand-in"
    page_size = 1

    def __init__(self, tp_size: int) -> None:
        self.tp_size, self.dp_size, self.pp_size = tp_size, 1, 1

    def __getattr__(self, name: str) -> None:
        return None

    def resolved_dict(self) -> dict:
        return {"tp_size": self.tp_size, "dp_size": self.dp_size, "pp_size": self.pp_size}


class StandInTokenizerManager:
    """The TokenizerManager surface SGLang's routes call, recording every request object they decoded."""

    def __init__(self, ranks: list[Any], spec: TensorSpec, model_path: str) -> None:
        from sglang.srt.managers.tokenizer_manager import ServerStatus

        self.ranks = ranks
        self.records: list[dict] = []
        self.model_path = self.served_model_name = model_path
        self.is_generation, self.gracefully_exit = True, False
        self.server_status = ServerStatus.Up
        self.last_receive_tstamp = 0.0
        self.startup_time = time.time()
        self.rid_to_state: dict = {}
        self.weight_version = "default"
        self.model_config = types.SimpleNamespace(
            vocab_size=1000,
            is_image_understandable_model=False,
            is_audio_understandable_model=False,
            hf_config=types.SimpleNamespace(model_type="stand-in", architectures=["StandIn"]),
        )
        self.server_args = _ServerArgs(tp_size=len(ranks))
        self._next_token = 0

    def _record(self, obj: Any) -> None:
        import msgspec

        if dataclasses.is_dataclass(obj):
            fields = dataclasses.asdict(obj)
        else:  # io_struct classes are array-like msgspec structs: by field name, not position
            fields = {name: msgspec.to_builtins(getattr(obj, name)) for name in obj.__struct_fields__}
        self.records.append({"class": type(obj).__name__, "fields": fields})

    async def _fan_out(self, op: str, **kw: Any) -> tuple[bool, str]:
        def call(conn: Any) -> tuple[str, Any]:
            conn.send((op, kw))
            return conn.recv()

        answers = await asyncio.gather(*(asyncio.to_thread(call, c) for c in self.ranks))
        errors = [f"tp rank {r}: {a[1]}" for r, a in enumerate(answers) if a[0] == "error"]
        if errors:
            return False, "; ".join(errors)
        failed = [f"tp rank {r}: {a[1][1]}" for r, a in enumerate(answers) if isinstance(a[1], tuple) and not a[1][0]]
        return (False, "; ".join(failed)) if failed else (True, "Succeeded.")

    # generation and control
    async def generate_request(self, obj: Any, request: Any = None) -> Any:
        from sglang.srt.sampling.sampling_params import SamplingParams

        obj.normalize_batch_and_arguments()
        self._record(obj)
        items = [obj] if obj.is_single else [obj[i] for i in range(obj.batch_size)]
        out = []
        for item in items:
            try:
                params = SamplingParams(**(item.sampling_params or {}))
            except TypeError as exc:  # an unknown sampling parameter
                raise ValueError(f"sampling_params: {exc}") from exc
            params.normalize(_BYTE_TOKENIZER)  # a real server normalises with the model's tokenizer
            params.verify(self.model_config.vocab_size)
            out.append(self._answer(item, params))
        self.last_receive_tstamp = time.time()
        yield out[0] if obj.is_single else out

    def _answer(self, item: Any, params: Any) -> dict:
        ids = list(item.input_ids or [])
        n = params.max_new_tokens if params.max_new_tokens is not None else 4
        output_ids = [(self._next_token + k) % 1000 for k in range(n)]
        self._next_token += n
        start = item.logprob_start_len if item.logprob_start_len not in (None, -1) else len(ids)
        meta = {
            "id": item.rid,
            "finish_reason": {"type": "length", "length": n},
            "prompt_tokens": len(ids),
            "completion_tokens": n,
            "cached_tokens": 0,
            "weight_version": self.weight_version,
        }
        if item.return_logprob:
            meta["output_token_logprobs"] = [[-0.5, t, None] for t in output_ids]
            meta["input_token_logprobs"] = [[None if k == 0 else -1.0, t, None] for k, t in enumerate(ids)][start:]
        return {"text": "", "output_ids": output_ids, "meta_info": meta}

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        self.records.append({"class": "AbortReq", "fields": {"rid": rid, "abort_all": abort_all}})

    async def pause_generation(self, obj: Any) -> None:
        self._record(obj)

    async def continue_generation(self, obj: Any) -> None:
        self._record(obj)

    async def flush_cache(self, timeout_s: float = 0.0) -> Any:
        self.records.append({"class": "FlushCache", "fields": {"timeout_s": timeout_s}})
        return types.SimpleNamespace(success=True, message="")

    async def release_memory_occupation(self, obj: Any, request: Any = None) -> None:
        self._record(obj)

    async def resume_memory_occupation(self, obj: Any, request: Any = None) -> None:
        self._record(obj)

    async def update_weight_version(self, obj: Any) -> None:
        self._record(obj)
        self.weight_version = obj.new_version

    def config_value(self, name: str) -> Any:
        return {"weight_version": self.weight_version}.get(name)

    async def get_internal_state(self) -> list[dict]:
        return [{"num_running_reqs": 0}]

    def is_ready(self) -> bool:
        return True

    # weights: fanned out to every TP rank, as the TokenizerManager's communicators do
    def _version(self, ok: bool, obj: Any) -> None:
        if ok and getattr(obj, "weight_version", None) is not None:
            self.weight_version = obj.weight_version

    async def init_weights_update_group(self, obj: Any, request: Any = None) -> tuple[bool, str]:
        self._record(obj)
        return await self._fan_out(
            "init_group",
            master_address=obj.master_address,
            master_port=obj.master_port,
            rank_offset=obj.rank_offset,
            world_size=obj.world_size,
            group_name=obj.group_name,
            backend=obj.backend,
        )

    async def destroy_weights_update_group(self, obj: Any, request: Any = None) -> tuple[bool, str]:
        self._record(obj)
        return await self._fan_out("destroy_group", group_name=obj.group_name)

    async def update_weights_from_distributed(self, obj: Any, request: Any = None) -> tuple[bool, str]:
        self._record(obj)
        ok, msg = await self._fan_out(
            "update_distributed",
            names=obj.names,
            dtypes=obj.dtypes,
            shapes=obj.shapes,
            group_name=obj.group_name,
            load_format=obj.load_format,
        )
        self._version(ok, obj)
        return ok, msg

    async def update_weights_from_tensor(self, obj: Any, request: Any = None) -> tuple[bool, str]:
        self._record(obj)
        if len(obj.serialized_named_tensors) < len(self.ranks):  # each TP rank indexes its own entry
            return (
                False,
                f"{len(obj.serialized_named_tensors)} serialized_named_tensors for {len(self.ranks)} TP ranks",
            )
        ok, msg = await self._fan_out(
            "update_tensor", serialized=list(obj.serialized_named_tensors), load_format=obj.load_format
        )
        self._version(ok, obj)
        return ok, msg

    async def update_weights_from_disk(self, obj: Any, request: Any = None) -> tuple[bool, str, int]:
        self._record(obj)  # a model loader from disk needs a real model config: the request is only recorded
        return False, "stand-in: update_weights_from_disk is validated and recorded, not loaded", 0


def _body_class(route: Any) -> type | None:
    """The request class a route decodes its JSON body into (None for routes without one)."""
    try:
        hints = typing.get_type_hints(route.endpoint, include_extras=True)
    except Exception:  # noqa: BLE001 - routes whose annotations do not resolve take no body we send
        return None
    hint = hints.get("obj")
    while typing.get_origin(hint) in (typing.Annotated, typing.Union, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return hint if isinstance(hint, type) else None


def _class_fields(cls: type) -> set[str]:
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    return set(getattr(cls, "__struct_fields__", ()))


def _strict_fields(app: Any) -> Any:
    """ASGI middleware: a JSON body field the route's request class lacks is a 400."""
    import json

    from starlette.responses import JSONResponse
    from starlette.routing import Match

    async def middleware(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT"):
            return await app(scope, receive, send)
        chunks, more = [], True
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        cls = next((_body_class(r) for r in app.routes if r.matches(scope)[0] == Match.FULL), None)
        try:
            parsed = json.loads(body) if body else {}
        except ValueError:
            parsed = None
        if cls is not None and isinstance(parsed, dict) and (extra := sorted(set(parsed) - _class_fields(cls))):
            message = f"stand-in: {scope['path']} got fields {extra} that {cls.__name__} does not have"
            return await JSONResponse({"error": {"message": message}}, status_code=400)(scope, receive, send)

        async def replay() -> dict:
            return {"type": "http.request", "body": body, "more_body": False}

        return await app(scope, replay, send)

    return middleware


def _serve_engine(report: Any, tp_size: int, spec: TensorSpec, seed: int, api_key: str | None) -> None:
    """Body of a forked engine: fork its TP processes, then serve SGLang's app until killed."""
    os.setsid()
    ranks = []
    for r in range(tp_size):
        parent, child = mp.Pipe()
        if os.fork() == 0:
            _tp_rank_main(child, r, spec, seed)
            os._exit(0)
        ranks.append(parent)
    import uvicorn
    from fastapi.responses import JSONResponse
    from sglang.srt.entrypoints import http_server as hs
    from sglang.srt.utils.auth import add_api_key_middleware

    tm = StandInTokenizerManager(ranks, spec, model_path="stand-in-model")
    hs.set_global_state(hs._GlobalState(tokenizer_manager=tm, template_manager=None, scheduler_info={}))
    # the runtime context launch_server publishes, as far as the routes used here read it
    hs.get_serving = lambda: types.SimpleNamespace(tokenizer_path="stand-in-model", preferred_sampling_params=None)
    hs.get_disagg = lambda: types.SimpleNamespace(disaggregation_mode="null")

    async def records() -> JSONResponse:
        return JSONResponse(tm.records)

    async def dump() -> JSONResponse:
        answers = [await asyncio.to_thread(lambda c=c: (c.send(("dump", {})), c.recv())[1]) for c in ranks]
        return JSONResponse({"weight_version": tm.weight_version, "ranks": [a[1] for a in answers]})

    async def fields() -> JSONResponse:  # the request class each route decodes its body into, with its fields
        classes = {r.path: _body_class(r) for r in hs.app.routes if getattr(r, "endpoint", None) is not None}
        return JSONResponse({p: [c.__name__, sorted(_class_fields(c))] for p, c in classes.items() if c is not None})

    hs.app.add_api_route("/standin/fields", fields, methods=["GET"])
    hs.app.add_api_route("/standin/records", records, methods=["GET"])
    hs.app.add_api_route("/standin/dump", dump, methods=["GET"])
    if api_key:
        add_api_key_middleware(hs.app, api_key=api_key, admin_api_key=None)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    report.send(f"http://127.0.0.1:{port}")
    threading.Thread(target=_die_with_parent, args=(os.getppid(),), daemon=True).start()
    uvicorn.run(_strict_fields(hs.app), host="127.0.0.1", port=port, log_level="warning", lifespan="off")


def _die_with_parent(parent: int) -> None:
    """An engine whose zygote is gone (killed without closing the fleet) takes its TP processes down."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os.killpg(0, signal.SIGKILL)


def _zygote_main(conn: Any) -> None:
    """Import SGLang once, then fork engines on request: ("start", tp_size, spec, seed, api_key) | ("stop", pid)."""
    try:
        version = import_sglang()
    except Exception as exc:  # noqa: BLE001 - reported to the fleet, which skips the tests with it
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", version))
    engines: list[int] = []
    try:
        while True:
            try:
                msg = conn.recv()
            except EOFError:
                return
            if msg[0] == "start":
                report, child = mp.Pipe()
                pid = os.fork()
                if pid == 0:
                    try:
                        _serve_engine(child, *msg[1:])
                    finally:
                        os._exit(0)
                engines.append(pid)
                conn.send(("started", report.recv() if report.poll(60) else None, pid))
            elif msg[0] == "stop":
                _kill_group(msg[1])
                conn.send(("stopped", msg[1]))
    finally:
        for pid in engines:
            _kill_group(pid)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass


class StandInFleet:
    """The zygote process and the engines forked from it; `skip_reason` is set when SGLang cannot import."""

    def __init__(self, import_timeout_s: float = 300.0) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_zygote_main, args=(child,), daemon=True)
        self.process.start()
        self._import_timeout_s = import_timeout_s
        self.version: str | None = None
        self.skip_reason: str | None = None
        self.engine_pids: list[int] = []

    def wait_ready(self) -> None:
        if self.version is not None or self.skip_reason is not None:
            return
        if not self._conn.poll(self._import_timeout_s):
            raise TimeoutError(f"importing sglang took more than {self._import_timeout_s:.0f}s")
        status, detail = self._conn.recv()
        if status == "ready":
            self.version = detail
        else:
            self.skip_reason = f"sglang does not import here: {detail}"

    def start_engine(self, spec: TensorSpec, *, tp_size: int = 1, seed: int = 0, api_key: str | None = None) -> str:
        """Fork one engine of `tp_size` TP processes; returns its URL once it answers /health."""
        self.wait_ready()
        self._conn.send(("start", tp_size, spec, seed, api_key))
        _, url, pid = self._conn.recv()
        if url is None:
            raise RuntimeError("the stand-in engine did not report its address")
        self.engine_pids.append(pid)
        _wait_listening(url)
        return url

    def close(self) -> None:
        if self.process.is_alive():
            self._conn.close()  # EOF: the zygote kills its engines' process groups and exits
            self.process.join(30)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(10)


def _wait_listening(url: str, timeout_s: float = 60.0) -> None:
    host, port = url.removeprefix("http://").split(":")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, int(port)), timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"stand-in engine at {url} is not listening after {timeout_s:.0f}s")


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@contextmanager
def fleet() -> Iterator[StandInFleet]:
    f = StandInFleet()
    try:
        yield f
    finally:
        f.close()
