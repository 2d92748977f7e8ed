"""The checks of the run config's core keys that need more than a range: the run id (an MQTT
topic level), the strategy (a registered method), the model (a zoo name, a spec, a user's file
or layer list), the codec, the window and FedFC's cut per profile."""

from __future__ import annotations

from typing import Any, Mapping


from sfl_core.config.fields import (
    Fail,
)
from sfl_core.config.values import integer_in
from sfl_core.method_registry import strategies
from sfl_core.wire.assignment import MAX_WINDOW
from sfl_core.wire.codec import CODECS, TOPK_PATTERN, is_codec
from sfl_core.wire.protocol import check_id


def _ident(v: Any, fail: Fail) -> str:
    try:
        return check_id("run", v)
    except ValueError:
        fail("1-64 characters of letters, digits, '-' or '_' (it becomes an MQTT topic level)")


def _strategy(v: Any, fail: Fail) -> str:
    """A built-in strategy or one registered with :func:`sfl_core.methods.register_method`."""
    known = strategies()
    if v not in known:
        fail("one of " + ", ".join(repr(c) for c in known))
    return v


def _codec(v: Any, fail: Fail) -> str:
    if not is_codec(v):
        fail("one of " + ", ".join(repr(c) for c in CODECS) + f" or {TOPK_PATTERN}")
    return v


def _window(v: Any, fail: Fail) -> int | str:
    """Steps in flight per split agent: 1 to :data:`MAX_WINDOW`, or 'auto' (the time model's choice)."""
    if v == "auto":
        return v
    return integer_in(1, MAX_WINDOW, what=f"an integer from 1 to {MAX_WINDOW}, or 'auto'")(v, fail)


def _model(v: Any, fail: Fail) -> str:
    """A zoo model name, a spec string (``vgg16:width=0.25,norm=group``), a mapping
    ``{name: vgg16, width: 0.25, norm: group}``, a user's ``FILE.py:FUNCTION`` or a layer list
    ``{layers: [...]}`` (:mod:`sfl_core.model.user_models`); stored as the canonical spec string."""
    from sfl_core.model.user_models import FILE_REF, register_file_model, register_layers
    from sfl_core.model.zoo import ModelSpec  # torch is only needed once a model is named

    if isinstance(v, Mapping) and set(v) == {"layers"}:
        try:
            return register_layers(v["layers"])
        except ValueError as exc:
            fail(f"a valid layer list ({exc})")
    ref = FILE_REF.match(v.strip()) if isinstance(v, str) else None
    if ref:
        try:
            v = register_file_model(ref["path"], ref["func"]) + (f":{ref['opts']}" if ref["opts"] else "")
        except ValueError as exc:
            fail(f"a model file and function, FILE.py:FUNCTION ({exc})")
    if isinstance(v, Mapping):
        extra = set(v) - {"name", "width", "norm"}
        if extra or "name" not in v:
            fail("a mapping with 'name' and optionally 'width', 'norm'")
        opts = [f"{k}={v[k]}" for k in ("width", "norm") if k in v]
        v = str(v["name"]) + (":" + ",".join(opts) if opts else "")
    if not isinstance(v, str):
        fail("a model name such as 'vgg16' or 'vgg16:width=0.25'")
    try:
        return str(ModelSpec.parse(v))
    except ValueError as exc:
        fail(f"a known model with valid options ({exc})")
        raise
