"""docs/config.md, generated from the sections: `python -m miles.config.docs > docs/config.md`.

`miles config --markdown` prints the same text; tests/unit/test_docs_current.py fails when the file
on disk differs from it.
"""

from __future__ import annotations

import sys

from miles.config.fields import groups, section_description
from miles.config.ranges import NUMBER_RANGES

INTRO = [
    "# Configuration reference",
    "",
    "Generated from the sections in `miles/config/sections/` by `python -m miles.config.docs > docs/config.md`",
    "(or `miles config --markdown`); edit the dataclasses, not this file.",
    "",
    "Every field is a command-line flag and a YAML key. In YAML a key may be the flag name",
    "(`rollout-batch-size: 8`), the field name (`rollout_batch_size: 8`), or nested under its section",
    "(`rollout: {rollout_batch_size: 8}`); the sections below are the YAML sections and the groups of",
    "`miles train --help`. Booleans take `--flag` / `--no-flag`; list flags take several",
    "values. Flags given on the command line override the file given with `--config`. A numeric flag",
    "outside its range (`[`/`]` include the bound, `(`/`)` exclude it) is refused at start-up. Any other",
    "`--sglang-<name> VALUE` flag is passed through to `sglang.launch_server --<name> VALUE`",
    "(kept in `engine.sglang_args`; in YAML under `sglang:`). The embedded engine reads five of them as",
    "SGLang does, `--sglang-disable-cuda-graph`, `--sglang-disable-radix-cache` (prefix sharing off),",
    "`--sglang-quantization fp8`, `--sglang-kv-cache-dtype` (`auto`, `fp8_e4m3` or `fp8_e5m2`: what its",
    "KV cache stores) and `--sglang-dtype` (what the engines compute in and weights travel in; default",
    "`--dtype`), and refuses any other.",
    "",
    "The batch knobs obey `rollout_batch_size × n_samples_per_prompt = global_batch_size ×",
    "num_steps_per_rollout`: give any three and the fourth is derived (see docs/concepts.md).",
    "",
]


def _md(text: str) -> str:
    return str(text).replace("|", "\\|")


def _range_cell(name: str) -> str:
    return f"`{NUMBER_RANGES[name][0]}`" if name in NUMBER_RANGES else ""


def render_markdown() -> str:
    """The configuration reference (docs/config.md is this output)."""
    lines = list(INTRO)
    for group, specs in groups().items():
        lines += [
            f"## {group}",
            "",
            section_description(group),
            "",
            "| flag | type | default | range | description |",
            "|---|---|---|---|---|",
        ]
        for spec in specs:
            flag = f"`{spec.flag}`" if spec.cli else f"`{spec.name}` (YAML only)"
            type_name = spec.type_name + (" or None" if spec.optional else "")
            lines.append(
                f"| {flag} | {type_name} | `{_md(repr(spec.default))}` | {_range_cell(spec.name)} | {_md(spec.help)} |"
            )
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(render_markdown())
