"""Field checks shared by every YAML file the product reads: run configs and device profiles
(:mod:`sfl_core.config`) and agent settings (:mod:`edge_agent.settings`).

One style of error for all of them — ``<file>: field '<path>': expected <what>, got <value>``,
unknown keys with a did-you-mean, duplicate keys and YAML syntax errors with their line —
so an operator fixes any file the same way.
"""

from __future__ import annotations

import difflib
import math
import os
from pathlib import Path
from typing import Any, Callable, Mapping, NoReturn, Sequence

import yaml

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


def failer(source: str, path: str, value: Any) -> Fail:
    def fail(expected: str) -> NoReturn:
        raise ConfigError(f"{source}: field '{path}': expected {expected}, got {value!r}")
    return fail


def check_mapping(d: Any, allowed: Sequence[str], source: str, prefix: str) -> dict[str, Any]:
    if not isinstance(d, Mapping):
        where = f"field '{prefix}'" if prefix else "top level"
        raise ConfigError(f"{source}: {where}: expected a mapping (key: value lines), got {d!r}")
    for k in d:
        if not isinstance(k, str) or k not in allowed:
            close = difflib.get_close_matches(str(k), allowed, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise ConfigError(
                f"{source}: field '{field_path(prefix, str(k))}': unknown key{hint} "
                f"(expected one of: {', '.join(allowed)})"
            )
    return dict(d)


def convert(d: dict[str, Any], spec: Mapping[str, Conv], source: str, prefix: str) -> dict[str, Any]:
    """Each value through its key's converter (``spec``), errors naming the file and field path."""
    out = {}
    for key, value in d.items():
        path = field_path(prefix, key)
        out[key] = spec[key](value, failer(source, path, value))
    return out


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
