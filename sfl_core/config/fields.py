"""Field checks shared by every YAML file the product reads: run configs and device profiles
(:mod:`sfl_core.config.run`) and agent settings (:mod:`edge_agent.settings`).

One style of error for all of them — ``<file>: field '<path>': expected <what>, got <value>``,
unknown keys with a did-you-mean, duplicate keys and YAML syntax errors with their line —
so an operator fixes any file the same way. The files are validated by pydantic v2 models;
the glue at the end of this module keeps pydantic's errors in that style.
"""

from __future__ import annotations

import difflib
import math
import os
from pathlib import Path
from typing import Any, Callable, ClassVar, Mapping, NoReturn, Sequence

import yaml
from pydantic import ConfigDict, PlainValidator, TypeAdapter, ValidationError, model_validator
from pydantic_core import ArgsKwargs, PydanticCustomError

YAML_SUFFIXES = (".yaml", ".yml")


class ConfigError(ValueError):
    """A profile or run file is invalid.

    The message always names the file, the field path and what was expected, e.g.
    ``profiles/runs/demo.yaml: field 'rounds': expected a positive integer, got 'ten'``.
    """


Fail = Callable[[str], NoReturn]
Conv = Callable[[Any, Fail], Any]


def number(v: Any) -> float | int | None:
    """int/float as is, numeric strings ('5e9', '1_000') parsed; bools and NaN/inf rejected."""
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, str):
        s = v.strip().replace("_", "")
        try:
            return int(s)
        except ValueError:
            pass
        try:
            x = float(s)
        except ValueError:
            return None
        return x if math.isfinite(x) else None
    return None


def field_path(prefix: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{prefix}[{key}]"
    return f"{prefix}.{key}" if prefix else key


class StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys (PyYAML silently keeps the last one)."""


def _construct_mapping(loader: StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    loader.flatten_mapping(node)
    mapping: dict[Any, Any] = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=deep)
        try:
            duplicate = key in mapping
        except TypeError:
            raise yaml.constructor.ConstructorError(
                None, None, f"unhashable key {key!r}", key_node.start_mark) from None
        if duplicate:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark)
        mapping[key] = loader.construct_object(value_node, deep=deep)
    return mapping


StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def read_yaml(path: Path) -> Any:
    source = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{source}: file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{source}: cannot read: {exc}") from None
    try:
        return yaml.load(text, Loader=StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{source}: line {mark.line + 1}, column {mark.column + 1}" if mark else source
        problem = exc.problem or exc.context or "syntax error"
        raise ConfigError(f"{where}: invalid YAML: {problem}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: invalid YAML: {exc}") from None


def looks_like_path(name_or_path: str) -> bool:
    return name_or_path.endswith(YAML_SUFFIXES) or "/" in name_or_path or os.sep in name_or_path


# ------------------------------------------------------------------------ pydantic glue
#
# The config types are pydantic v2 dataclasses: pydantic walks the nesting, builds the frozen
# objects, re-validates on ``dataclasses.replace`` and reports where each problem is (its
# ``loc``). What it cannot give by itself is this product's one-line message style, so each
# field's check is one of the converters above wrapped by :func:`checked`, sections reject
# unknown keys with a did-you-mean (:class:`Section`), and :func:`validate` turns the first
# error into a :class:`ConfigError` naming the file and the field path.


STRICT = ConfigDict(extra="forbid", arbitrary_types_allowed=False)
"""The pydantic config of every section: unknown keys are errors (``Section`` names them first)."""


def _raise_expected(what: str) -> NoReturn:
    raise PydanticCustomError("expected", "expected {what}", {"what": what})


def invalid(field: str, message: str) -> PydanticCustomError:
    """A relational error found after a section's fields were checked: ``field`` is the path below
    the section (``'widths'``, ``'mergesfl.max_batch'``), ``message`` what follows its name."""
    return PydanticCustomError("config", "{message}", {"field": field, "message": message})


def checked(conv: Conv) -> PlainValidator:
    """A converter (``conv(value, fail)``) as a pydantic validator: its ``fail(what)`` becomes an
    ``expected`` error that :func:`validate` words as ``expected <what>, got <value>``."""
    def validate_one(v: Any) -> Any:
        return conv(v, _raise_expected)
    return PlainValidator(validate_one)


class Section:
    """Mixin of every config type (pydantic dataclasses and models): ``null`` is an empty section, a non-mapping or an unknown
    key is refused with the allowed keys (and a did-you-mean), and a required field's absence
    says what it expected. ``YAML_KEYS`` renames YAML keys to attributes (``run`` -> ``run_id``);
    ``REQUIRED`` maps each required YAML key to what it expects."""

    YAML_KEYS: ClassVar[Mapping[str, str]] = {}
    REQUIRED: ClassVar[Mapping[str, str]] = {}
    GATHERED: ClassVar[str] = ""
    """A field that is not a YAML key but holds the keys :meth:`gathered_keys` names (the run
    config's ``sections``: one YAML key per method section); :meth:`gather` fills it."""
    SHORTHAND: ClassVar[str] = ""
    """The field a bare value stands for (``drift: scaffold`` is ``{kind: scaffold}``, ``model_ema: 0.8``
    is ``{decay: 0.8}``); "": none."""

    @classmethod
    def gathered_keys(cls) -> list[str]:
        return []

    @classmethod
    def gather(cls, data: dict[str, Any]) -> dict[str, Any]:
        return data

    @model_validator(mode="before")
    @classmethod
    def _mapping_with_known_keys(cls, data: Any) -> Any:
        if data is None:
            return {}
        if isinstance(data, cls):
            return data
        if isinstance(data, ArgsKwargs):   # built in code (``DataConfig()``, a default): pydantic checks it
            if cls.GATHERED and data.kwargs and not data.args:
                return ArgsKwargs((), cls.gather(dict(data.kwargs)))
            return data
        if cls.SHORTHAND and not isinstance(data, (Mapping, list, tuple)):
            data = {cls.SHORTHAND: data}
        if not isinstance(data, Mapping):
            raise PydanticCustomError("config", "{message}", {
                "field": "", "message": f"expected a mapping (key: value lines), got {data!r}"})
        to_yaml = {attr: key for key, attr in cls.YAML_KEYS.items()}
        allowed: list[str] = []
        for f in cls.__pydantic_fields__:  # type: ignore[attr-defined]
            allowed += cls.gathered_keys() if f == cls.GATHERED else [to_yaml.get(f, f)]
        for k in data:
            if not isinstance(k, str) or k not in allowed:
                close = difflib.get_close_matches(str(k), allowed, n=1)
                hint = f"; did you mean '{close[0]}'?" if close else ""
                raise PydanticCustomError("config", "{message}", {
                    "field": str(k), "message": f"unknown key{hint} (expected one of: {', '.join(allowed)})"})
        for key, what in cls.REQUIRED.items():
            if key not in data:
                raise PydanticCustomError("config", "{message}", {
                    "field": key, "message": f"expected {what}, but it is missing"})
        data = {cls.YAML_KEYS.get(k, k): v for k, v in data.items()}
        return cls.gather(data) if cls.GATHERED else data


def _path(loc: Sequence[Any], renames: Mapping[str, str]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part:
            out = field_path(out, renames.get(part, part))
    return out


def describe_error(err: Mapping[str, Any], renames: Mapping[str, str] = {}) -> tuple[str, str]:
    """(field path, message) of one pydantic error, as :func:`error_line` words them."""
    ctx = err.get("ctx") or {}
    path = _path(list(err["loc"]) + str(ctx.get("field", "")).split("."), renames)
    if err["type"] == "config":
        message = ctx["message"]
    elif err["type"] == "expected":
        message = f"expected {ctx['what']}, got {err['input']!r}"
    else:   # pydantic's own wording, for what the sections leave to it
        message = f"{err['msg']}, got {err.get('input')!r}"
    return path, message


def read_section(cls: type, key: str, data: Any) -> Any:
    """``data`` as a ``cls`` section under YAML key ``key`` of an enclosing section; its first
    error is re-raised as that section's own (``field 'key.sub': ...``)."""
    try:
        return TypeAdapter(cls).validate_python(data)
    except ValidationError as exc:
        path, message = describe_error(exc.errors()[0])
        raise PydanticCustomError("config", "{message}", {
            "field": f"{key}.{path}" if path else key, "message": message}) from None


def error_line(source: str, err: Mapping[str, Any], renames: Mapping[str, str] = {}) -> str:
    """One pydantic error as this product words it (``<file>: field '<path>': expected ...``)."""
    path, message = describe_error(err, renames)
    if not path:
        return f"{source}: top level: {message}"
    return f"{source}: field '{path}': {message}"


def validate(cls: type, data: Any, source: str, context: Mapping[str, Any] | None = None) -> Any:
    """``data`` (a YAML document or a received body) as a ``cls`` instance, or a
    :class:`ConfigError` naming ``source`` and the first bad field."""
    try:
        return TypeAdapter(cls).validate_python(data, context=dict(context or {}))
    except ValidationError as exc:
        renames = {attr: key for key, attr in getattr(cls, "YAML_KEYS", {}).items()}
        raise ConfigError(error_line(source, exc.errors()[0], renames)) from None
