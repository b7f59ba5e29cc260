"""`miles session serve` and `miles session check`: the session server for agent developers.

    miles session serve --model-path DIR --port N [--tito-model chatml] [--use-session-server v2]
    miles session check --model-path DIR --tito-model NAME

`serve` runs the embedded engine behind the router and the session server, as a training run
does, on one port: `/sessions/{id}/v1/chat/completions` for multi-turn sessions and
`/v1/chat/completions` at the root (one new session per request), so any OpenAI client can try
it with `base_url=http://HOST:N/v1`. `check` runs the CPU append-only check of a model family on
a checkpoint's tokenizer and prints the first divergence of each conversation that breaks.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal

from miles.agent.families import FAMILIES, resolve_family
from miles.agent.gateway import Gateway
from miles.agent.matchers import MATCHERS, resolve_matcher
from miles.agent.openai_protocol import ChatDefaults
from miles.agent.server import DEFAULT_MAX_BODY_MB, start_gateway
from miles.agent.sessions import RULES
from miles.agent.tito import TitoTokenizer, check_append_only
from miles.config import NUMBER_RANGES as R
from miles.config import ranged
from miles.controller.router import Router
from miles.engines.client import EngineClient
from miles.engines.doors import warn_if_open
from miles.engines.http_front import engine_from_args, start_http_server

logger = logging.getLogger(__name__)


def _family_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-path", required=True, help="HF model directory (weights + tokenizer)")
    parser.add_argument(
        "--tito-model",
        default="default",
        help=f"model family: {', '.join(sorted(FAMILIES))} or an import path of a ModelFamily",
    )


def parse_serve_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="miles session serve",
        description="Serve the session server over an embedded engine (OpenAI chat completions, token-in-token-out).",
    )
    _family_args(p)
    p.add_argument("--host", default="127.0.0.1", help="listen address (default loopback only)")
    p.add_argument("--port", type=ranged(int, R["controller_port"][0]), default=30000, help="0 picks a free port")
    p.add_argument(
        "--use-session-server", default="v1", choices=sorted(RULES), help="session rule: v1 linear, v2 branching"
    )
    p.add_argument(
        "--session-message-matcher",
        default="strict",
        help=f"{', '.join(MATCHERS)} or an import path of fn(stored, replayed) -> bool",
    )
    p.add_argument(
        "--max-tokens",
        type=ranged(int, R["rollout_max_response_len"][0]),
        default=256,
        help="new tokens per turn when a request gives none",
    )
    p.add_argument(
        "--generate-max-turns",
        type=ranged(int, R["generate_max_turns"][0]),
        default=16,
        help="most model turns per session",
    )
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (sessions: their id)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-running-requests", type=ranged(int, R["max_running_requests"][0]), default=64)
    p.add_argument("--max-total-tokens", type=ranged(int, R["max_total_tokens"][0]), default=None)
    p.add_argument("--seed", type=ranged(int, R["seed"][0]), default=0)
    p.add_argument(
        "--max-body-mb",
        type=ranged(float, R["http_max_body_mb"][0]),
        default=DEFAULT_MAX_BODY_MB,
        help="largest request body in MiB (413 above)",
    )
    return p.parse_args(argv)


def tito_for(model_path: str, family_spec: str) -> tuple[TitoTokenizer, list[str]]:
    from transformers import AutoTokenizer

    tito = TitoTokenizer(resolve_family(family_spec), AutoTokenizer.from_pretrained(model_path))
    return tito, check_append_only(tito)


async def _serve(args: argparse.Namespace) -> None:
    tito, problems = tito_for(args.model_path, args.tito_model)
    if problems:
        logger.warning(
            "--tito-model %s is not append-only for %s (%s); requests may fail or diverge; see `miles session check`",
            args.tito_model,
            args.model_path,
            problems[0],
        )
    engine = engine_from_args(args)
    await engine.start()
    engine_front = await start_http_server(engine, "127.0.0.1", 0, api_key=args.api_key)
    router = Router([EngineClient(engine_front.url, api_key=args.api_key)], session_mode=True)
    gateway = Gateway(
        router,
        tito,
        rule=RULES[args.use_session_server],
        matcher=resolve_matcher(args.session_message_matcher),
        defaults=ChatDefaults(max_tokens=args.max_tokens, max_context_len=engine.max_seq_len),
        max_turns=args.generate_max_turns,
        model_name=os.path.basename(os.path.normpath(args.model_path)),
    )
    warn_if_open(args.host, args.api_key)
    handle = None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        handle = await start_gateway(
            gateway,
            args.host,
            args.port,
            api_key=args.api_key,
            max_body_mb=args.max_body_mb,
            max_body_flag="--max-body-mb",
        )
        # One parseable line on stdout: launchers and tests read the bound port from it.
        print(
            f"miles session server for {args.model_path} on {handle.url} (OpenAI base_url {handle.url}/v1)", flush=True
        )
        await stop.wait()
    finally:
        if handle is not None:
            await handle.stop()
        await router.close()
        await engine_front.stop()
        await engine.shutdown()


def serve_main(argv: list[str] | None = None) -> int:
    args = parse_serve_args(argv)
    asyncio.run(_serve(args))
    return 0


def check_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="miles session check",
        description="The CPU append-only check of a model family on a checkpoint's tokenizer.",
    )
    _family_args(p)
    args = p.parse_args(argv)
    tito, problems = tito_for(args.model_path, args.tito_model)
    for line in problems:
        print(line)
    verdict = "not append-only" if problems else "append-only"
    print(
        f"--tito-model {tito.family.name} on {args.model_path}: {verdict} "
        f"(end of turn {tito.end_of_turn!r}, id {tito.end_of_turn_id})"
    )
    return 1 if problems else 0
