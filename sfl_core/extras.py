"""Optional dependencies: which extra brings each, and one line for the operator when it is missing.

An agent installs lean (``pip install sfl-edge``: what training on a device needs); the
coordinator's own packages come with ``sfl-edge[coordinator]``, and two agent features have
their own extras. A feature whose package is missing says so in one line naming the command
that installs it, raised as the caller's own error type, so each command reports it like any
other configuration error (exit 2).
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import Type

__all__ = ["EXTRAS", "import_optional"]

EXTRAS = {
    "onnx": ("onnx", "coordinator"),
    "onnxruntime": ("onnxruntime", "predict"),
    "amqtt": ("amqtt", "coordinator"),
    "prometheus_client": ("prometheus-client", "coordinator"),
    "sklearn": ("scikit-learn", "demo"),
}
"""Top-level module -> (distribution, the extra of sfl-edge that installs it)."""

_NEEDS_310 = {"amqtt"}
"""Packages whose current releases need Python 3.10 or newer."""


def import_optional(name: str, purpose: str, error: Type[Exception] = ImportError) -> ModuleType:
    """Import ``name`` (a module of an optional dependency), or raise ``error`` with one line:
    what needs it (``purpose``) and the pip command that installs it."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        dist, extra = EXTRAS[name.split(".")[0]]
        if name.split(".")[0] in _NEEDS_310 and sys.version_info < (3, 10):
            raise error(f"{purpose} needs the package {dist}, which needs Python 3.10 or newer "
                        f"(this is {sys.version_info[0]}.{sys.version_info[1]})") from exc
        raise error(f"{purpose} needs the package {dist} ({exc}): pip install 'sfl-edge[{extra}]'") from exc
