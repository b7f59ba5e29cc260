"""Field specs of the config sections: flag names, types, choices, ranges, value conversion.

`FIELDS` maps every field name (unique across sections) to its section, type, default, choices,
range and help text; the parser, the YAML loader, the validators and docs/config.md all read it.
"""

from __future__ import annotations

import difflib
import types
import typing
from dataclasses import MISSING, dataclass, fields
from typing import Any

from miles.config.option import render_choices
from miles.config.sections import SECTIONS


class ConfigError(ValueError):
    """One or more configuration problems; the message lists all of them."""

    def __init__(self, errors: list[str] | str):
        self.errors = [errors] if isinstance(errors, str) else list(errors)
        if len(self.errors) == 1:
            text = f"config error: {self.errors[0]}"
        else:
            text = f"{len(self.errors)} config errors:\n" + "\n".join(f"  - {e}" for e in self.errors)
        super().__init__(text)


# ---------------------------------------------------------------- field specs


@dataclass(frozen=True, slots=True)
class FieldSpec:
    name: str
    section: str  # its attribute of MilesConfig: also its YAML section and help group (`async_` is `async`)
    base: type  # int, float, str, bool, list or dict
    elem: type | None  # element type of a list field
    optional: bool
    default: Any
    help: str  # `{choices}` rendered
    nargs: str | None
    cli: bool
    const: Any = None  # the value of a bare flag whose value is optional (nargs "?")
    choices: tuple[str, ...] | None = None  # a Literal field's values
    range: str | None = None  # a number's interval (see miles.config.option)
    unit: str | None = None  # what the number counts, said when it is out of range

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def group(self) -> str:
        """The help group and YAML section the field is listed under."""
        return self.section.rstrip("_")

    @property
    def type_name(self) -> str:
        if self.base is list:
            return f"list[{self.elem.__name__}]"
        return self.base.__name__


def _unwrap(hint: Any) -> tuple[Any, bool, tuple[str, ...] | None]:
    """A field's type hint -> (the type without None, whether None is allowed, the Literal's choices)."""
    optional = False
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional, hint = True, args[0]
    if typing.get_origin(hint) is typing.Literal:
        return str, optional, tuple(typing.get_args(hint))
    return hint, optional, None


def _spec(section: str, f: Any, hint: Any) -> FieldSpec:
    hint, optional, choices = _unwrap(hint)
    origin = typing.get_origin(hint) or hint
    elem = (typing.get_args(hint)[0] if typing.get_args(hint) else str) if origin is list else None
    meta = f.metadata
    text = meta["help"]
    if choices:
        text = render_choices(text, choices, meta["notes"], meta["sep"])
    elif meta["notes"]:
        raise TypeError(f"config field {f.name!r} has notes on choices but no Literal type")
    return FieldSpec(
        name=f.name,
        section=section,
        base=origin,
        elem=elem,
        optional=optional,
        default=f.default_factory() if f.default_factory is not MISSING else f.default,
        help=text,
        nargs=meta.get("nargs", "*" if origin is list else None),
        cli=meta["cli"],
        const=meta.get("const"),
        choices=choices,
        range=meta["range"],
        unit=meta["unit"],
    )


def _field_specs() -> dict[str, FieldSpec]:
    specs: dict[str, FieldSpec] = {}
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            if f.name in specs:
                raise TypeError(f"config field {f.name!r} is defined in both {specs[f.name].section} and {section}")
            specs[f.name] = _spec(section, f, hints[f.name])
    return specs


FIELDS: dict[str, FieldSpec] = _field_specs()


def groups() -> dict[str, list[FieldSpec]]:
    """Fields by help group, which is their YAML section, in section order."""
    out: dict[str, list[FieldSpec]] = {section.rstrip("_"): [] for section in SECTIONS}
    for spec in FIELDS.values():
        out[spec.group].append(spec)
    return out


def section_description(group: str) -> str:
    """A section's one-line description: its class docstring."""
    cls = SECTIONS.get(group) or SECTIONS[group + "_"]
    return (cls.__doc__ or "").strip()


# ---------------------------------------------------------------- value conversion

_TRUE, _FALSE = {"true", "yes", "on", "1"}, {"false", "no", "off", "0"}


def _convert_scalar(kind: type, raw: Any) -> Any:
    if kind is bool:
        if isinstance(raw, bool):
            return raw
        if isinstance(raw, int) and raw in (0, 1):
            return bool(raw)
        if isinstance(raw, str) and raw.lower() in _TRUE | _FALSE:
            return raw.lower() in _TRUE
        raise ValueError
    if kind is int:
        if isinstance(raw, bool):
            raise ValueError
        if isinstance(raw, float) and raw.is_integer():
            return int(raw)
        return int(raw) if isinstance(raw, (int, str)) else _fail()
    if kind is float:
        if isinstance(raw, bool):
            raise ValueError
        return float(raw) if isinstance(raw, (int, float, str)) else _fail()
    if kind is str:
        return str(raw) if isinstance(raw, (str, int, float)) and not isinstance(raw, bool) else _fail()
    if kind is dict:
        return dict(raw) if isinstance(raw, dict) else _fail()
    raise ValueError


def _fail() -> Any:
    raise ValueError


def convert(spec: FieldSpec, raw: Any, source: str) -> Any:
    """Coerce a YAML or command-line value to the field's type; ConfigError names the source."""
    if spec.const is not None and isinstance(raw, bool):  # YAML `flag: true` is the bare flag
        return spec.const if raw else None
    if raw is None or (spec.optional and isinstance(raw, str) and raw.lower() in ("none", "null")):
        if spec.optional:
            return None
        raise ConfigError(
            f"{source}: {spec.name} cannot be empty (expected {spec.type_name}, default {spec.default!r})"
        )
    try:
        if spec.base is list:
            items = raw if isinstance(raw, (list, tuple)) else [raw]
            if spec.elem in (int, float):  # numbers also come comma separated: --profile-steps 3,4
                items = [p for x in items for p in (x.split(",") if isinstance(x, str) else [x]) if p != ""]
            return [_convert_scalar(spec.elem, x) for x in items]
        return _convert_scalar(spec.base, raw)
    except (ValueError, TypeError):
        raise ConfigError(f"{source}: {spec.name} expects {spec.type_name}, got {raw!r}") from None


def parse_scalar(text: str) -> Any:
    """Best-effort typing of a passthrough value: int, float, bool, else the string."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    return text


def flag(name: str) -> str:
    """The command-line flag of field `name`."""
    return FIELDS[name].flag


def closest_flag(flag: str) -> str | None:
    candidates = [s.flag for s in FIELDS.values() if s.cli] + ["--config"]
    match = difflib.get_close_matches(flag, candidates, n=1, cutoff=0.6)
    return match[0] if match else None


def unknown_flag_message(flag: str, where: str = "") -> str:
    near = closest_flag(flag)
    hint = f"; closest valid flag: {near}" if near else "; see `miles train --help` for valid flags"
    return f"unknown flag {flag}{where}{hint}"
