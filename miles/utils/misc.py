"""Small shared helpers: plug-in loading, the line for a missing file."""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from typing import Any


class PluginError(ImportError):
    pass


def load_function(path: str | None) -> Callable[..., Any] | Any | None:
    """Resolve "pkg.mod.attr" or "pkg.mod:attr" to the object; None for an empty path.

    A bad path raises PluginError naming the path and the underlying import error, so a
    mistyped plug-in fails at start-up rather than at step 37.
    """
    if not path:
        return None
    if ":" in path:
        module_name, _, attr = path.partition(":")
    else:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise PluginError(f"plug-in path {path!r} is not of the form 'pkg.module.attr' or 'pkg.module:attr'")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - report any import failure with the path
        raise PluginError(f"cannot import module {module_name!r} for plug-in {path!r}: {type(e).__name__}: {e}") from e
    obj = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as e:
            raise PluginError(f"module {module_name!r} has no attribute {attr!r} (plug-in {path!r})") from e
    return obj


def missing_file_line(what: str, path: str | os.PathLike) -> str:
    """One line for a path that names no file; a relative one says where it was looked for (the working
    directory), since configs written for the project root name their data relative to it."""
    where = "" if os.path.isabs(path) else f" (relative to the working directory {os.getcwd()})"
    return f"{what} {str(path)!r}{where} does not exist or is not a file; check the path"
