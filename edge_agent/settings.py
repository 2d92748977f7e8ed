"""Command settings from a YAML file (``sfl-agent start --config agent.yaml``).

Why a file at all: on a board the agent runs under systemd, and a dozen flags in a
unit's ``ExecStart=`` are hard to edit, easy to break, and put the broker password in
``ps`` output. So every option of a command may also be written in a YAML file whose
keys are the options' Python names (``shard_file``, not ``--shard-file``).

Why through click's ``default_map``: the file's values become the command's *defaults*,
so the command line (and an option's environment variable) still wins, the values go
through the very same type conversion and callbacks as typed flags, and
``ctx.get_parameter_source(name)`` reports ``DEFAULT_MAP`` for them. Nothing here lists
the command's options: they are read from the command itself, so an option added to
``start`` later (TLS files, a password file, ...) works in the file without changes.

Why check the file ourselves first: click would silently turn ``index: 3.5`` into 3
and report a bad value without naming the file. So the file is validated by a pydantic
model built from the command's options; as in :mod:`sfl_core.config.run`, unknown keys are
refused with a did-you-mean, wrong types name the file and the key, and
relative paths are taken relative to the file's directory (a unit's working directory
is not where the operator wrote the file).
"""

from __future__ import annotations

import enum
import os
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Collection, Iterable, List, Mapping, Optional

from pydantic import BaseModel, BeforeValidator, create_model
from typing_extensions import Annotated  # typing.Annotated needs Python 3.9

from sfl_core.config.fields import (
    STRICT,
    ConfigError,
    Fail,
    Section,
    checked,
    invalid,
    looks_like_path,
    number,
    read_yaml,
    validate,
)

__all__ = ["OptionSpec", "command_option_specs", "load_settings_file", "settings_from_mapping", "use_config_file"]

_PATH_SUFFIXES = ("_file", "_dir", "_path")


@dataclass(frozen=True)
class OptionSpec:
    """What checking one option's value from a file needs to know.

    ``kind``: ``bool``, ``int``, ``float``, ``str``, ``path`` or ``any`` (left to the
    command's own conversion). ``path``: ``"always"`` = a relative value is resolved
    against the file's directory; ``"maybe"`` = only when it looks like a path (a device
    profile is a name *or* a YAML path); ``None`` = never. ``multiple``: a list of values.
    """

    kind: str = "any"
    path: str | None = None
    multiple: bool = False


# ------------------------------------------------------------------------ pure checking


def _convert_scalar(kind: str, value: Any, fail: Fail) -> Any:
    """One value of an option of ``kind``; YAML types are checked strictly (3.5 is no integer)."""
    if kind == "bool":
        if not isinstance(value, bool):
            fail("true or false")
        return value
    if kind == "int":
        x = number(value)
        if x is None or (isinstance(x, float) and not x.is_integer()):
            fail("an integer")
        return int(x)
    if kind == "float":
        x = number(value)
        if x is None:
            fail("a number")
        return float(x)
    if kind in ("str", "path"):
        # a run id or profile name of digits arrives as a YAML number; that is still a name
        if isinstance(value, bool) or not isinstance(value, (str, int, float)) or str(value) == "":
            fail("a non-empty string" if kind == "str" else "a path (a non-empty string)")
        return str(value)
    if isinstance(value, (dict, list)):
        fail("a single value")
    return value


def _resolve(value: str, base_dir: Path) -> str:
    """``~`` expanded; a relative path joined to the settings file's directory (a Hugging Face
    builder reference, ``hf:BUILDER:PATH``, has its PATH joined)."""
    if value.startswith("hf:") and value.count(":") >= 2:
        builder, _, rest = value[3:].partition(":")
        return f"hf:{builder}:{_resolve(rest, base_dir)}"
    p = Path(os.path.expanduser(value))
    return str(p if p.is_absolute() else base_dir / p)


class _SettingsBase(Section, BaseModel):
    model_config = STRICT


def _settings_model(options: Mapping[str, OptionSpec]) -> type[BaseModel]:
    """A pydantic model of the command's options (every one optional: a file sets some of them)."""
    def one(kind: str) -> Any:
        return Annotated[Any, checked(lambda v, fail: _convert_scalar(kind, v, fail))]

    def a_list(kind: str) -> Any:
        def require_list(v: Any) -> Any:
            if not isinstance(v, list):
                raise invalid("", f"expected a list of values (kind {kind}), got {v!r}")
            return v
        return Annotated[List[one(kind)], BeforeValidator(require_list)]  # type: ignore[misc]

    fields: dict[str, Any] = {key: (Optional[a_list(spec.kind) if spec.multiple else one(spec.kind)], None)
                              for key, spec in options.items()}
    return create_model("AgentSettings", __base__=_SettingsBase, **fields)


def settings_from_mapping(raw: Any, options: Mapping[str, OptionSpec], source: str,
                          base_dir: Path) -> dict[str, Any]:
    """Checked, converted settings from a parsed YAML document.

    ``options`` maps each allowed key to its spec. An empty document gives no settings;
    a ``null`` value means "not set" (the option keeps its default). Raises
    :class:`ConfigError` naming ``source`` and the key for unknown keys (with a
    did-you-mean) and wrong types.
    """
    if raw is None:
        return {}
    if isinstance(raw, Mapping):
        raw = {k: v for k, v in raw.items() if v is not None}
    settings = validate(_settings_model(dict(sorted(options.items()))), raw, source)
    out: dict[str, Any] = {}
    for key in [k for k in raw if k in settings.model_fields_set]:
        value, spec = getattr(settings, key), options[key]
        items = value if spec.multiple else [value]
        if spec.path == "always" or (spec.path == "maybe" and isinstance(items[0], str) and looks_like_path(items[0])):
            items = [_resolve(v, base_dir) for v in items]
        out[key] = items if spec.multiple else items[0]
    return out


def load_settings_file(path: str | Path, options: Mapping[str, OptionSpec]) -> dict[str, Any]:
    """:func:`settings_from_mapping` of a YAML file (duplicate keys and bad YAML refused)."""
    path = Path(os.path.expanduser(str(path)))
    return settings_from_mapping(read_yaml(path), options, str(path), path.resolve().parent)


# ------------------------------------------------------------------------ click glue

# click's parameter type names (typer < 0.20, click itself)
_KINDS = {"boolean": "bool", "integer": "int", "integer range": "int", "float": "float",
          "float range": "float", "text": "str", "path": "path", "choice": "str"}


def _kind_of_annotation(ann: Any) -> tuple[str, bool]:
    """(kind, multiple) of a Python annotation such as ``Optional[Path]`` or ``list[int]``."""
    origin = typing.get_origin(ann)
    if origin in (list, tuple, set, frozenset):
        args = [a for a in typing.get_args(ann) if a is not Ellipsis]
        return (_kind_of_annotation(args[0])[0] if args else "any"), True
    if origin is not None:  # Optional[X] / Union[X, None] / X | None
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        return _kind_of_annotation(args[0]) if len(args) == 1 else ("any", False)
    if isinstance(ann, type):
        if issubclass(ann, bool):
            return "bool", False
        if issubclass(ann, int):
            return "int", False
        if issubclass(ann, float):
            return "float", False
        if issubclass(ann, os.PathLike):
            return "path", False
        if issubclass(ann, str) or issubclass(ann, enum.Enum):
            return "str", False
    return "any", False


def _kind_of(param: Any) -> tuple[str, bool]:
    """(kind, multiple) of a command parameter: typer >= 0.20 keeps the annotation in
    ``type_descriptor``; typer < 0.20 and plain click have a click type with a name."""
    multiple = bool(getattr(param, "multiple", False)) or getattr(param, "nargs", 1) not in (1, None)
    ann = getattr(getattr(param, "type_descriptor", None), "annotation", None)
    if ann is not None:
        kind, listed = _kind_of_annotation(ann)
        return kind, multiple or listed
    return _KINDS.get(getattr(getattr(param, "type", None), "name", ""), "any"), multiple


def command_option_specs(params: Iterable[Any], exclude: Collection[str] = (),
                         path_options: Collection[str] = (),
                         maybe_path_options: Collection[str] = ()) -> dict[str, OptionSpec]:
    """Specs of a click command's options, read from the parameters themselves.

    Duck-typed on purpose (``param.name``, the annotation or click type, ``param.multiple``):
    typer >= 0.20 vendors click and keeps the Python annotation, older typer uses click itself. Path options are the
    ``Path``-typed ones, those named ``*_file`` / ``*_dir`` / ``*_path``, and
    ``path_options``; ``maybe_path_options`` are resolved only when the value looks
    like a path.
    """
    specs: dict[str, OptionSpec] = {}
    for p in params:
        name = getattr(p, "name", None)
        if not name or name in exclude or getattr(p, "param_type_name", "option") != "option":
            continue
        kind, multiple = _kind_of(p)
        if name in maybe_path_options:
            path = "maybe"
        elif kind == "path" or name in path_options or name.endswith(_PATH_SUFFIXES):
            path = "always"
        else:
            path = None
        specs[name] = OptionSpec(kind=kind, path=path, multiple=multiple)
    return specs


def use_config_file(ctx: Any, param: Any, value: Any, *, path_options: Collection[str] = (),
                    maybe_path_options: Collection[str] = ()) -> Any:
    """Eager ``--config`` callback: the file's settings become the command's defaults.

    Must run before the other options are processed (``is_eager=True``), so that their
    values come from the command line, else their environment variable, else the file,
    else their default. A bad file is a usage error (exit status 2), with the file's
    path and the key in the message.
    """
    if value is None or getattr(ctx, "resilient_parsing", False):
        return value
    specs = command_option_specs(ctx.command.params, exclude={param.name},
                                 path_options=path_options, maybe_path_options=maybe_path_options)
    try:
        settings = load_settings_file(value, specs)
    except ConfigError as exc:
        import typer  # the CLI's dependency, not this module's: the pure part above needs no click

        raise typer.BadParameter(str(exc), ctx=ctx, param=param) from None
    ctx.default_map = {**(ctx.default_map or {}), **settings}
    return value
