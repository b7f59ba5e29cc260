"""What an engine's HTTP front lets in: who (the API key), how much (body size), and which paths.

Key: as SGLang's `--api-key`, every request but `GET /health` must carry
`Authorization: Bearer <key>`; anything else gets HTTP 401 with a one-line JSON error. The
comparison is constant-time. A run makes a fresh key when the user gives none
(`new_api_key`), hands it to every engine it starts and every client it creates, and never logs
it nor writes it to the run directory (`redact` for command lines that carry it).

Size: a body that declares more than the limit is refused with 413 before a byte of it is read;
a chunked body is cut off at the limit by aiohttp's `client_max_size`. JSON bodies are parsed
strictly: NaN, Infinity and numbers that overflow a float are refused (400).

Paths: the endpoints that name directories (`/pull_weights`, `/update_weights_from_disk`) may only
touch directories the engine was started with (`WeightDirs`); the model it serves is readable too.
Shared-memory segment names are checked where they are opened (miles/weights/tensor_ipc.py).
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import math
import os
import secrets
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

AUTH_HEADER = "Authorization"
OPEN_PATHS = frozenset({"/health"})  # liveness only; /health_generate runs a generation, so it needs the key
DEFAULT_MAX_BODY_MB = 64
REDACTED = "<redacted>"
# weight endpoint -> {payload field naming a directory: whether the engine writes there}
WEIGHT_PATH_FIELDS = {
    "pull_weights": {"local_checkpoint_dir": True, "source_dir": False},
    "update_weights_from_disk": {"model_path": False},
}

logger = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class PathRefused(PermissionError):
    """A weight endpoint named a path outside the directories this engine may touch (HTTP 403)."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def warn_if_open(host: str, api_key: str | None) -> None:
    """A front without a key is for loopback; say so loudly when it listens anywhere else."""
    if not api_key and not is_loopback(host):
        logger.warning(
            "engine HTTP front on %s has no API key: anyone who can reach the port can generate and replace "
            "the weights; pass --api-key or listen on 127.0.0.1",
            host,
        )


def new_api_key() -> str:
    """A fresh random key (256 bits, URL-safe): one per run."""
    return secrets.token_urlsafe(32)


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {AUTH_HEADER: f"Bearer {api_key}"} if api_key else {}


def redact(text: str, api_key: str | None) -> str:
    """`text` (a command line, an error) with the key replaced, fit for a log."""
    return text.replace(api_key, REDACTED) if api_key else text


def json_error(status: int, message: str) -> web.Response:
    """The front's error body: our contract's `error` plus SGLang's `success`/`message` pair."""
    return web.json_response({"error": message, "success": False, "message": message}, status=status)


def api_key_middleware(api_key: str) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
    expected = f"Bearer {api_key}".encode()

    @web.middleware
    async def check_key(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in OPEN_PATHS and request.method in ("GET", "HEAD"):
            return await handler(request)
        given = request.headers.get(AUTH_HEADER, "").encode()
        if not hmac.compare_digest(given, expected):
            what = "no API key" if not given else "a wrong API key"
            return json_error(
                401,
                f"{request.method} {request.path}: {what}; this engine wants 'Authorization: Bearer <key>' "
                "with the key it was started with (--api-key)",
            )
        return await handler(request)

    return check_key


def body_limit_middleware(
    max_bytes: int, flag: str = "--http-max-body-mb", server: str = "engine"
) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
    """413 for a body over `max_bytes`, naming `flag`: the flag of the command in use that raises the limit."""

    @web.middleware
    async def check_size(request: web.Request, handler: Handler) -> web.StreamResponse:
        declared = request.content_length
        if declared is not None and declared > max_bytes:
            return json_error(413, _too_large(request, declared, max_bytes, flag, server))
        try:
            return await handler(request)
        except web.HTTPRequestEntityTooLarge:  # a chunked body that ran past client_max_size
            return json_error(413, _too_large(request, None, max_bytes, flag, server))

    return check_size


def _too_large(request: web.Request, declared: int | None, max_bytes: int, flag: str, server: str) -> str:
    size = f"{declared} bytes" if declared is not None else f"more than {max_bytes} bytes"
    return (
        f"{request.method} {request.path}: body of {size} is over the {server}'s limit of {max_bytes} bytes "
        f"({max_bytes / 2**20:g} MiB); send less per request, or raise {flag}"
    )


def _refuse_constant(name: str) -> float:
    raise ValueError(f"the JSON body holds {name}, which JSON does not allow; send finite numbers")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the JSON body holds the number {text[:40]}, which overflows a float; send finite numbers")
    return value


def loads_strict(raw: bytes | str) -> Any:
    """json.loads refusing NaN, Infinity and numbers that overflow to inf (ValueError, i.e. HTTP 400)."""
    return json.loads(raw, parse_constant=_refuse_constant, parse_float=_finite_float)


@dataclass(frozen=True, slots=True)
class WeightDirs:
    """The directories a weight endpoint may name: `writable` ones (the run's), plus `readable` (the model)."""

    writable: tuple[Path, ...] = ()
    readable: tuple[Path, ...] = ()

    @classmethod
    def of(cls, writable: Iterable[str | os.PathLike], model_path: str | os.PathLike | None = None) -> WeightDirs:
        write = tuple(_real(d) for d in writable if d)
        read = write + ((_real(model_path),) if model_path else ())
        return cls(write, read)

    def check(self, endpoint: str, body: dict) -> None:
        """Raise PathRefused when a path field of `endpoint`'s body leaves the allowed directories."""
        for name, write in WEIGHT_PATH_FIELDS.get(endpoint, {}).items():
            if name in body:
                self.check_path(str(body[name]), write=write, what=f"/{endpoint} {name}")

    def check_path(self, path: str, *, write: bool, what: str) -> Path:
        resolved = _real(path)  # symlinks and '..' resolved: a link inside an allowed directory cannot lead out
        roots = self.writable if write else self.readable
        if any(resolved == root or resolved.is_relative_to(root) for root in roots):
            return resolved
        allowed = ", ".join(str(r) for r in roots) or "none (the engine was started without weight directories)"
        access = "write" if write else "read"
        raise PathRefused(
            f"{what}={path!r} ({resolved}) is outside the directories this engine may {access}: {allowed}; "
            "use the run's --update-weight-disk-dir or run directory (miles engine serve: --weight-dir)"
        )


def _real(path: str | os.PathLike) -> Path:
    return Path(os.path.realpath(os.path.expanduser(os.fspath(path))))
