"""Split-learning methods behind one seam (:class:`Method`); the round engine runs any of them.

A run's method is its ``strategy`` (the base: where the model is cut) plus the layers its
config asks for::

    strategy: fedavg | sfl | s2fl        ->  FedAvg, SFL (FedFC with profile_splits), S2FL
    strategy: auto                       ->  the joint planner (split, codec, batch per agent)
    hetero: {width / codecs}             ->  + HeteroSFL (per-group widths and codecs)
    mergesfl: {select / regulate}        ->  + MergeSFL (selection and batch sizes)

A new method is one module: a :class:`Method` subclass (or a :class:`Layer`), registered with
:func:`register_method` (or :func:`register_layer`); the engine needs no change.

The method classes live in their modules (``sfl_core.methods.s2fl.method.S2FL``, ...) and the seam in
:mod:`sfl_core.methods.base`; this package itself imports neither, so reading the registry
(the run config checks ``strategy:`` against it) never imports a method.
"""

from __future__ import annotations

from sfl_core.method_registry import (
    build_method,
    register_layer,
    register_method,
    register_section,
    strategies,
    unregister_method,
    unregister_section,
)

__all__ = ["build_method", "register_layer", "register_method", "register_section", "strategies",
           "unregister_method", "unregister_section"]
