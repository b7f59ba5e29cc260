"""`option()`: one config field, with everything its flag, its YAML key and docs/config.md say about it.

A section is a dataclass whose fields are `option(...)`s. The field's type is the flag's type; a
`typing.Literal` type is the list of its choices (written there once: the help text names them
with `{choices}`, the parser and the start-up check read them from the type). `range` is the
interval a number must lie in (`"[" "]"` include the bound, `"(" ")"` exclude it, `" or "` adds single
values: `"-1 or [1, inf)"`) and `unit` what the number counts; both are checked at start-up.
"""

from __future__ import annotations

from dataclasses import field
from typing import Any

MAX_SAMPLES_PER_STEP = 2**20  # rollout_batch_size x n_samples_per_prompt (Sample objects held at once)
MAX_GROUP_SIZE = 2**16
SEED_RANGE = "[0, 4294967295]"  # numpy's seed range, the narrowest of the generators seeded from it
PORT_RANGE = "[0, 65535]"


def option(
    default: Any,
    help: str,
    *,
    range: str | None = None,
    unit: str | None = None,
    notes: dict[str, str] | None = None,
    sep: str = " | ",
    nargs: str | None = None,
    const: Any = None,
    cli: bool = True,
    secret: bool = False,
) -> Any:
    """A dataclass field carrying its help text and flag settings in its metadata.

    `notes` gives a word on some choices (`{choices}` renders `a (note) | b`, joined by `sep`); `nargs` and
    `const` are argparse's (a bare flag with `const` means that value); `cli=False` keeps a field out of the
    command line (YAML only); `secret` fields are never written out (config.yaml, --dry-run, logs).
    """
    meta = {"help": help, "range": range, "unit": unit, "notes": notes or {}, "sep": sep, "cli": cli}
    meta.update({k: v for k, v in (("nargs", nargs), ("const", const), ("secret", secret)) if v})
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return field(default=default, metadata=meta)


def render_choices(template: str, choices: tuple[str, ...], notes: dict[str, str], sep: str) -> str:
    """The help text with `{choices}` replaced by the choices, each with its note in parentheses."""
    listed = sep.join(f"{c} ({notes[c]})" if c in notes else c for c in choices)
    return template.replace("{choices}", listed)
