"""The run's rollout gateway: the session server and the router's /generate for plug-ins, on the controller.

It starts when `--use-session-server` or any plug-in layer (rollout, generate, agent function) is
set, listens on 127.0.0.1 (`--session-server-port`, default a free port) and wants the run's API
key except on a session's own routes; bodies over `--http-max-body-mb` get 413. Plug-ins find it where Miles' plug-ins find the router:
`args.sglang_router_ip` / `args.sglang_router_port`; `args.engine_context_len` is the most tokens
one request (prompt + new tokens) may hold on the engines.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

from miles.agent.families import resolve_family
from miles.agent.gateway import Gateway
from miles.agent.matchers import resolve_matcher
from miles.agent.openai_protocol import ChatDefaults
from miles.agent.server import GatewayHandle, start_gateway
from miles.agent.sessions import RULES
from miles.agent.tito import TitoTokenizer, check_append_only
from miles.config import MilesConfig
from miles.utils.routing import routing_shape

logger = logging.getLogger(__name__)
HOST = "127.0.0.1"


def needs_gateway(cfg: MilesConfig) -> bool:
    r = cfg.rollout
    return bool(
        r.use_session_server
        or r.rollout_function_path
        or r.custom_generate_function_path
        or r.custom_agent_function_path
    )


def session_tokenizer(cfg: MilesConfig, tokenizer: Any) -> TitoTokenizer:
    """The family `--tito-model` names over the run's tokenizer, after the CPU append-only check.

    A registered family that fails the check on this tokenizer is refused (ValueError); `default`,
    the unverified fallback, only warns.
    """
    family = resolve_family(cfg.rollout.tito_model)
    tito = TitoTokenizer(family, tokenizer)
    problems = check_append_only(tito)
    if problems and family.name != "default":
        raise ValueError(
            f"--tito-model {cfg.rollout.tito_model}: the chat template is not append-only for "
            f"{cfg.model.hf_checkpoint}: {problems[0]}; pick another family or fix its registration"
        )
    if family.name == "default":
        logger.warning(
            "--tito-model default: the checkpoint's own chat template, not a registered family; "
            "incremental tokenisation may diverge from the template's output%s",
            f" ({problems[0]})" if problems else "",
        )
    return tito


def engine_context_len(placement: Any) -> int | None:
    """The most tokens (prompt + new) one request may hold on every planned rollout engine (None: unknown)."""
    limits = []
    for spec in placement.specs:
        kw = spec.init_kwargs
        if spec.role != "rollout":
            continue
        if kw.get("engine") == "embedded" and kw.get("max_total_tokens"):
            limits.append(kw["max_total_tokens"] // kw["max_running_requests"])
        elif kw.get("sglang_args", {}).get("context_length"):
            limits.append(int(kw["sglang_args"]["context_length"]))
    return min(limits) if limits else None


def check_session_server(cfg: MilesConfig, tokenizer: Any) -> None:
    """Start-up checks before any worker starts: the matcher loads, the family passes the append-only check."""
    resolve_matcher(cfg.rollout.session_message_matcher)
    if cfg.rollout.use_session_server:
        session_tokenizer(cfg, tokenizer)


def chat_defaults(cfg: MilesConfig, context_len: int | None) -> ChatDefaults:
    r = cfg.rollout
    limits = [n for n in (r.rollout_max_context_len, context_len) if n]
    return ChatDefaults(
        temperature=r.rollout_temperature,
        top_p=r.rollout_top_p,
        top_k=r.rollout_top_k,
        min_p=r.rollout_min_p,
        max_tokens=r.rollout_max_response_len,
        max_context_len=min(limits) if limits else None,
        stop=list(r.rollout_stop or []),
        stop_token_ids=list(r.rollout_stop_token_ids or []),
        routing=routing_shape(cfg.model.hf_checkpoint) if cfg.train.use_rollout_routing_replay else None,
    )


async def start_rollout_gateway(
    cfg: MilesConfig, router: Any, tokenizer: Any, context_len: int | None
) -> GatewayHandle:
    """Serve the gateway over `router`, reading the rollout, model and engine sections."""
    r = cfg.rollout
    sessions = bool(r.use_session_server)
    tito = session_tokenizer(cfg, tokenizer) if sessions else None
    gateway = Gateway(
        router,
        tito,
        rule=RULES[r.use_session_server] if sessions else "linear",
        matcher=resolve_matcher(r.session_message_matcher),
        defaults=chat_defaults(cfg, context_len),
        max_turns=r.generate_max_turns,
        model_name=os.path.basename(os.path.normpath(cfg.model.hf_checkpoint or "miles")),
    )
    handle = await start_gateway(
        gateway, HOST, r.session_server_port, api_key=cfg.engine.api_key, max_body_mb=cfg.engine.http_max_body_mb
    )
    return handle


def point_plugins_at(args: argparse.Namespace, handle: GatewayHandle, context_len: int | None) -> None:
    """Where Miles' plug-ins look for the router: `args.sglang_router_ip` / `args.sglang_router_port`, and
    `args.engine_context_len` for the most tokens one request may hold (the plug-in boundary, the only
    place the run's flat namespace is written)."""
    args.sglang_router_ip, args.sglang_router_port = HOST, handle.port
    args.engine_context_len = context_len
