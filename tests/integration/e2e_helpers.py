"""The run helpers under their former module name; they live in `tests/harness.py`."""

from harness import DEMO, REPO, leftover_processes, python_path, read_rows, run_train, train_command  # noqa: F401
