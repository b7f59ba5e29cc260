"""The `miles` command.

Each subcommand imports its implementation only when it runs, so `miles --help` stays instant.
Configuration and placement errors exit with status 2 and a message on stderr, without a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import importlib
import inspect
import json
import logging
import sys
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

EXIT_USAGE = 2
EXIT_RUN_FAILED = 1

COMMANDS = {
    "train": "train with RL: miles train --config FILE [--flag value ...] (see miles train --help)",
    "tiny-model": "write a tiny randomly initialised HF model: miles tiny-model OUT_DIR [--arch ...]",
    "engine": "run a rollout engine: miles engine serve --model-path DIR --port N",
    "session": "the session server for agents: miles session serve --model-path DIR --port N | session check",
    "config": "print the configuration reference: miles config --markdown",
    "plot": "plot the curves of a run: miles plot RUN_DIR",
    "sweep": "expand, list, run or submit a grid sweep: miles sweep SWEEP.yaml [--list | --task-id N | --submit]",
    "convert": "convert a checkpoint: miles convert gguf SRC.gguf OUT_DIR | miles convert fp8 SRC DST",
    "data": "write a recipe's data offline: miles data gsm-symbolic [--out-dir DIR]",
}


class UsageError(Exception):
    """A problem the user fixes on the command line; printed without a traceback."""


def _top_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="miles", description="RL post-training for LLMs (no Ray).")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, text in COMMANDS.items():
        sub.add_parser(name, help=text, add_help=False)
    return parser


def _import_entry(module: str, attr: str, missing_message: str) -> Callable[..., Any]:
    """Import module:attr; a missing module (not a broken one) becomes a UsageError."""
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name is not None and (module == e.name or module.startswith(e.name + ".")):
            raise UsageError(missing_message) from None
        raise
    return getattr(mod, attr)


def _result_code(result: Any) -> int:
    if inspect.iscoroutine(result):
        result = asyncio.run(result)
    return result if isinstance(result, int) else 0


# ---------------------------------------------------------------- subcommands


def cmd_train(argv: list[str], base: dict[str, Any] | None = None) -> int:
    from pathlib import Path

    from miles.config import load_config, save_config
    from miles.controller.placement import PlacementError
    from miles.controller.preflight import PreflightError, check_start
    from miles.controller.run_dirs import RunDirError, lock_output_dir, output_dir_error
    from miles.models.resolve import resolve_model_paths
    from miles.utils.hf_cache import ModelNotFound

    cfg = load_config(argv, base=base)
    try:
        if cfg.runtime.dry_run:  # the config and the placement plan, nothing started, no model built
            from miles.controller.machine import dry_run_report

            print(json.dumps(dry_run_report(cfg), indent=2))
            return 0
        loop = "miles.controller.loop_async" if cfg.async_.fully_async else "miles.controller.loop_sync"
        run = _import_entry(loop, "run", "miles train: the training loop is not available yet")
        with lock_output_dir(cfg.runtime.output_dir):  # one run per --output-dir, from its first write to exit
            try:  # the resolved config (derived knobs included) next to the run's metrics: `--config` reruns it
                save_config(cfg, Path(cfg.runtime.output_dir) / "config.yaml")
            except OSError as e:
                raise output_dir_error(cfg.runtime.output_dir, e) from None
            check_start(cfg, scan_load_weights=False)  # a bad layout or path is refused before any model is built
            resolve_model_paths(cfg.model, seed=cfg.train.seed)  # the controller takes model directories only
            logger.info("starting %s with output_dir=%s", loop, cfg.runtime.output_dir)
            return _result_code(run(cfg))
    except PlacementError as e:  # raised before any worker starts
        raise UsageError(f"placement error: {e}") from None
    except (PreflightError, ModelNotFound, RunDirError) as e:  # bad paths, models (before any worker starts) or data
        raise UsageError(f"miles train: {e}") from None
    except Exception as e:  # a known cause (every group dropped, NaN loss, a dead worker or engine): one line
        line = one_line(e, cfg)
        if line is None:
            raise
        logger.debug("the run ended with", exc_info=e)
        if getattr(e, "log_tail", None):
            logger.info("last lines of %s:\n%s", getattr(e, "log_path", "its log"), e.log_tail)
        print(f"miles train: {line}", file=sys.stderr)
        return EXIT_RUN_FAILED


def one_line(exc: BaseException, cfg: Any = None) -> str | None:
    """The one line `miles train` prints for a run that ended for a known cause, else None (a bug:
    keep the traceback). A dead worker is named with how it died and where its log is; an engine
    that stopped answering is named with its address; an out-of-memory names the levers `cfg` (the run's
    config) does not already pull."""
    from miles.engines.client import EngineConnectionError
    from miles.errors import as_run_failure, out_of_memory_line
    from miles.wire.specs import WorkerDied

    failure = as_run_failure(exc)
    if failure is not None:
        return str(failure)
    oom = out_of_memory_line(exc, cfg)
    if oom is not None:
        return oom
    if isinstance(exc, WorkerDied):
        how = (
            f"killed by {exc.signal}"
            if exc.signal
            else (f"exit code {exc.exitcode}" if exc.exitcode is not None else "no answer")
        )
        where = f"; its log: {exc.log_path}" if exc.log_path else ""
        return f"worker {exc.role}:{exc.rank} (pid {exc.pid}, node {exc.node}) {exc.reason} ({how}){where}"
    if isinstance(exc, EngineConnectionError):
        return str(exc).splitlines()[0]
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
        where = f" writing {exc.filename}" if exc.filename else ""
        return (
            f"{exc.strerror}{where}; free space or make it writable, then run again "
            "(--auto-resume continues from the last checkpoint)"
        )
    return None


def cmd_tiny_model(argv: list[str]) -> int:
    main = _import_entry("miles.models.tiny", "main", "miles tiny-model: not available yet")
    return _result_code(main(argv))


def cmd_engine(argv: list[str]) -> int:
    if not argv or argv[0] != "serve":
        raise UsageError("usage: miles engine serve --model-path DIR --port N [...]")
    serve = _import_entry("miles.engines.http_front", "serve_main", "miles engine serve: not available yet")
    return _result_code(serve(argv[1:]))


def cmd_session(argv: list[str]) -> int:
    commands = {"serve": "serve_main", "check": "check_main"}
    if not argv or argv[0] not in commands:
        raise UsageError(
            "usage: miles session serve --model-path DIR --port N [...] | "
            "miles session check --model-path DIR --tito-model NAME"
        )
    entry = _import_entry("miles.controller.session_serve", commands[argv[0]], "miles session: not available")
    return _result_code(entry(argv[1:]))


def cmd_config(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="miles config", description="Print the configuration reference.")
    parser.add_argument("--markdown", action="store_true", help="Markdown tables (docs/config.md is this output)")
    args = parser.parse_args(argv)
    from miles.config import build_parser
    from miles.config.docs import render_markdown

    if args.markdown:
        sys.stdout.write(render_markdown())
    else:
        build_parser().print_help()
    return 0


def cmd_plot(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="miles plot", description="Write PNG curves of RUN_DIR/metrics.jsonl.")
    parser.add_argument("run_dir")
    args = parser.parse_args(argv)
    from miles.utils.plot import PlotUnavailable, plot_run, reward_curve

    try:
        written = plot_run(args.run_dir)
    except (FileNotFoundError, PlotUnavailable) as e:
        raise UsageError(f"miles plot: {e}" if isinstance(e, PlotUnavailable) else str(e)) from None
    curve = reward_curve(args.run_dir)
    if curve:
        print("rollout/reward_mean")
        print(curve)
    for path in written:
        print(path)
    return 0


def cmd_sweep(argv: list[str]) -> int:
    from miles.sweep import main as sweep_main

    return sweep_main(argv, train=cmd_train)


def cmd_convert(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="miles convert", description="Convert a checkpoint to a plain HF directory.")
    sub = parser.add_subparsers(dest="format", required=True)
    gguf = sub.add_parser("gguf", help="GGUF file -> HF directory (weights dequantized, with tokenizer)")
    gguf.add_argument("src", help="path of the .gguf file")
    gguf.add_argument("out_dir")
    gguf.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    fp8 = sub.add_parser("fp8", help="BF16 HF directory -> FP8 rollout checkpoint (e4m3, 128x128 block scales)")
    fp8.add_argument("src", help="HF directory of the bf16 checkpoint")
    fp8.add_argument("dst", help="new directory for the FP8 checkpoint")
    args = parser.parse_args(argv)
    if args.format == "fp8":
        return convert_fp8(args.src, args.dst)
    return convert_gguf(args.src, args.out_dir, args.dtype)


def convert_fp8(src: str, dst: str) -> int:
    from miles.engines.embedded.fp8_checkpoint import write_fp8_checkpoint

    try:
        out = write_fp8_checkpoint(src, dst)
    except (ValueError, OSError) as e:
        raise UsageError(f"miles convert fp8: {e}") from None
    print(f"wrote {out}")
    return 0


def convert_gguf(src: str, out_dir: str, dtype: str = "bfloat16") -> int:
    from miles.utils.gguf import GGUFConvertError
    from miles.utils.gguf import convert_gguf as convert

    try:
        out = convert(src, out_dir, dtype)
    except GGUFConvertError as e:
        raise UsageError(f"miles convert gguf: {e}") from None
    print(f"wrote {out}")
    return 0


DATASETS = {"gsm-symbolic": "miles.recipes.gsm_symbolic"}


def cmd_data(argv: list[str]) -> int:
    if not argv or argv[0] not in DATASETS:
        raise UsageError(f"miles data: name one of {sorted(DATASETS)}, e.g. miles data gsm-symbolic --out-dir DIR")
    module = importlib.import_module(DATASETS[argv[0]])
    try:
        return module.main(argv[1:])
    except FileNotFoundError as e:  # the source package is not installed: the message says what to install
        raise UsageError(f"miles data {argv[0]}: {e}") from None


HANDLERS: dict[str, Callable[[list[str]], int]] = {
    "train": cmd_train,
    "tiny-model": cmd_tiny_model,
    "engine": cmd_engine,
    "session": cmd_session,
    "config": cmd_config,
    "plot": cmd_plot,
    "sweep": cmd_sweep,
    "convert": cmd_convert,
    "data": cmd_data,
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in HANDLERS:
        parser = _top_parser()
        if not argv:
            parser.print_help()
            return EXIT_USAGE
        parser.parse_args(argv[:1])  # prints help (exit 0) or "invalid choice" (exit 2)
        return EXIT_USAGE
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from miles.config import ConfigError

    try:
        return HANDLERS[argv[0]](argv[1:])
    except (ConfigError, UsageError) as e:
        print(e, file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    raise SystemExit(main())
