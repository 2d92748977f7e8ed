"""Spare the objects a coordinator is set up with from the garbage collector's full passes.

Problem: by the time ``sfl-coord serve`` trains its first round, importing PyTorch, pydantic,
rich and the product has left hundreds of thousands of objects that Python's garbage collector tracks,
and nearly all of them live as long as the process (modules, classes, functions, the config).
The collector walks every one of them in each full collection, which a round's allocations
trigger from time to time: on the thread that trains the server's portion, in the middle of
a round, for as long as a hundred agents' server step takes.

What this does: one call once the process is set up (its imports done, its config and parts
checked) moves every object tracked so far into the collector's permanent generation
(``gc.freeze``), which later collections leave out. Objects made after it are collected as
before.

Why it is safe: a frozen object is still freed as soon as nothing refers to it (reference
counting does not look at generations); only a reference cycle among the frozen objects that
became garbage later would be kept until the process exits, and what exists before the first
round is what the process keeps to its end. It changes when memory is reclaimed, never what is
computed.
"""

from __future__ import annotations

import gc

__all__ = ["spare_startup_objects"]


def spare_startup_objects() -> int:
    """Move every object the collector tracks now into its permanent generation (``gc.freeze``);
    how many objects that generation holds after it."""
    gc.freeze()
    return gc.get_freeze_count()
