"""A run's fleet: ``count`` agents of a device profile each, the profile checked when the run
file is read (not when agent 37 starts), and a simulated device's own data."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Mapping, Optional

from pydantic import ValidationInfo, field_validator, model_validator
from pydantic.dataclasses import dataclass
from typing_extensions import Annotated  # typing.Annotated needs Python 3.9

from sfl_core.config.fields import (
    STRICT,
    ConfigError,
    Fail,
    Section,
    checked,
    invalid,
    looks_like_path,
)
from sfl_core.config.values import (
    NONEMPTY_STRING,
    POSITIVE_INTEGER,
)

from sfl_core.config.profiles import load_profile


def _data_path(v: Any, fail: Fail) -> Optional[str]:
    if v is None:
        return None
    if not isinstance(v, str) or not v.strip():
        fail("a path to data (an image folder, .npz, CSV, Parquet ...), or null")
    return v


def _anchored(v: Optional[str], info: ValidationInfo) -> Optional[str]:
    """A data path read from a file is relative to that file (``hf:`` builder references as given)."""
    base = (info.context or {}).get("base_dir")
    if v is None or base is None or Path(v).is_absolute() or v.startswith("hf:"):
        return v
    return str((Path(base) / v).resolve())


def _resolve_profile_path(p: str, base_dir: Path | None) -> str:
    """Relative profile paths: next to the run file first, then the working directory."""
    path = Path(p)
    if path.is_absolute():
        return str(path)
    if base_dir is not None and (base_dir / path).is_file():
        return str((base_dir / path).resolve())
    return str(path.resolve())


@dataclass(frozen=True, config=STRICT)
class FleetEntry(Section):
    """``count`` agents of one device profile (a profile name, or an absolute YAML path).

    Read from a file (validation context ``base_dir``/``search_dirs``), a relative path is
    resolved against the run file and the profile is loaded at once: a bad fleet fails when the
    file is read, not when agent 37 starts."""

    REQUIRED: ClassVar[Mapping[str, str]] = {"profile": "a device profile name or YAML path"}
    SHORTHAND: ClassVar[str] = "profile"   # '- jetson-nano' is one agent

    profile: Annotated[str, NONEMPTY_STRING]
    count: Annotated[int, POSITIVE_INTEGER] = 1
    data: Annotated[Optional[str], checked(_data_path)] = None
    """A simulated device's own data (a run with ``task``), relative to the run file; needs count 1."""


    @field_validator("data")
    @classmethod
    def _anchor_data(cls, v: Optional[str], info: ValidationInfo) -> Optional[str]:
        return _anchored(v, info)

    @model_validator(mode="after")
    def _one_device_one_folder(self) -> "FleetEntry":
        if self.data is not None and self.count != 1:
            raise invalid("count", f"one data path is one device: expected count 1 with 'data', got {self.count}")
        return self

    @field_validator("profile")
    @classmethod
    def _known_profile(cls, name: str, info: ValidationInfo) -> str:
        ctx = info.context
        if not ctx or "search_dirs" not in ctx:
            return name
        if looks_like_path(name):
            name = _resolve_profile_path(name, ctx.get("base_dir"))
        try:
            load_profile(name, ctx["search_dirs"])
        except ConfigError as exc:
            raise invalid("", f"expected a known device profile: {exc}") from None
        return name
