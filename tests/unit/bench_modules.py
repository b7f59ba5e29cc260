"""A bench script (bench/<name>.py, not a package) imported as a module, for tests of its CPU side."""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[2] / "bench"


def load_bench(name: str) -> ModuleType:
    if str(BENCH) not in sys.path:  # a bench imports its siblings (miles_runs, ...), as when run as a script
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses and pickling look the module up by name
    spec.loader.exec_module(mod)
    return mod
