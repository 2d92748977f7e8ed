"""Entry-point plugins: models, data sets and methods that installed packages declare.

One loader for the three registries (``sfl_edge.models``, ``sfl_edge.datasets``,
``sfl_edge.methods``): each group is read once, on first use, and a plugin that fails to
load is skipped with one logged line, so a broken package never stops a run that does not
use it.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Callable, Container

_loaded: set[str] = set()


def _entry_points(group: str) -> list:
    """The installed entry points of ``group`` (``entry_points(group=...)`` needs Python 3.10)."""
    from importlib.metadata import entry_points
    if sys.version_info >= (3, 10):
        return list(entry_points(group=group))
    return list(entry_points().get(group, []))


def load_entry_points(group: str, register: Callable[[str, Any], None], known: Container[str], what: str) -> None:
    """Call ``register(name, loaded_object)`` for each entry point of ``group`` not in ``known``
    (once per process; ``what`` names the kind in the log line)."""
    if group in _loaded:
        return
    _loaded.add(group)
    for ep in _entry_points(group):
        if ep.name in known:
            continue
        try:
            register(ep.name, ep.load())
        except Exception as exc:  # a broken plugin must not stop the runs that do not use it
            logging.getLogger("sfl.plugins").warning("%s plugin %s (%s) not loaded: %s", what, ep.name, ep.value, exc)
