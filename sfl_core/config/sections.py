"""The run config's core sections: the built-in data set and its partition (``data:``), the
task a device's own data must fit (``task:``), where the model is scored (``eval:``) and the
defenses agents apply (``privacy:``)."""

from __future__ import annotations

from typing import Any, ClassVar, Mapping, Optional, Union

from pydantic import ValidationInfo, field_validator, model_validator
from pydantic.dataclasses import dataclass
from typing_extensions import Annotated  # typing.Annotated needs Python 3.9

from sfl_core.config.fields import (
    STRICT,
    Conv,
    Fail,
    Section,
    checked,
    invalid,
    number,
    validate,
)
from sfl_core.config.values import (
    BOOLEAN,
    NONEMPTY_STRING,
    NONNEG_INTEGER,
    OPTIONAL_POSITIVE_INTEGER,
    POSITIVE_NUMBER,
    nonempty_string,
    nonneg_number,
    one_of,
    optional,
)
from sfl_core.data.partition import SCHEMES
from sfl_core.privacy import ActivationNoise, AgentPrivacy, DpSgd, LabelProtection, require_accountant

from sfl_core.config.fleet import _anchored, _data_path

PARTITIONS = SCHEMES
"""How the training set is split over agents (docs/methods/data-heterogeneity.md)."""


@dataclass(frozen=True, config=STRICT)
class DataConfig(Section):
    dataset: Annotated[str, NONEMPTY_STRING] = "digits"
    root: Annotated[Optional[str], checked(optional(nonempty_string))] = None  # relative paths are relative to the working directory
    partition: Annotated[str, checked(one_of(*PARTITIONS))] = "iid"
    alpha: Annotated[float, POSITIVE_NUMBER] = 0.5  # Dirichlet concentration; only used when partition == 'dirichlet'
    seed: Annotated[int, NONNEG_INTEGER] = 0
    image_size: Annotated[Optional[int], OPTIONAL_POSITIVE_INTEGER] = None  # resize images to image_size x image_size
    bad_files: Annotated[str, checked(one_of("skip", "fail"))] = "skip"
    """A device's unreadable file: skipped and counted ('skip'), or the end of that device ('fail')."""


def _class_names(v: Any, fail: Fail) -> tuple[str, ...]:
    what = "a list of at least two distinct class names (folder names), in label order"
    if not isinstance(v, (list, tuple)) or len(v) < 2:
        fail(what)
    names = []
    for c in v:
        if isinstance(c, bool) or not isinstance(c, (str, int)) or not str(c).strip() or "/" in str(c) \
                or str(c) in (".", ".."):
            fail(what)
        names.append(str(c))
    if len(set(names)) != len(names):
        fail(what)
    return tuple(names)


def _input_shape(v: Any, fail: Fail) -> tuple[int, ...]:
    if not isinstance(v, (list, tuple)) or not 1 <= len(v) <= 3 or \
            not all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in v):
        fail("a per-sample shape: [channels, height, width] for images, [features] for a table")
    return tuple(v)


def _normalize(v: Any, fail: Fail) -> Union[str, tuple[tuple[float, ...], tuple[float, ...]]]:
    what = "'federated', 'none' or {mean: [one per channel], std: [positive, one per channel]}"
    if v in ("federated", "none"):
        return v
    if not isinstance(v, Mapping) or set(v) != {"mean", "std"}:
        fail(what)
    given = [[number(x) for x in v[k]] if isinstance(v[k], (list, tuple)) else [] for k in ("mean", "std")]
    mean, std = ([float(x) for x in g if x is not None] for g in given)
    if not mean or len(mean) != len(std) or len(mean) + len(std) != sum(map(len, given)) or any(x <= 0 for x in std):
        fail(what)
    return tuple(mean), tuple(std)


def _resize(v: Any, fail: Fail) -> Optional[tuple[int, int]]:
    if v is None:
        return None
    if isinstance(v, int) and not isinstance(v, bool) and v >= 1:
        return (v, v)
    if isinstance(v, (list, tuple)) and len(v) == 2 and all(isinstance(d, int) and not isinstance(d, bool)
                                                           and d >= 1 for d in v):
        return tuple(v)
    fail("null (images must already have the run's size), a size N (N x N) or [height, width]")


def _names(v: Any, fail: Fail) -> Optional[tuple[str, ...]]:
    if v is None:
        return None
    if not isinstance(v, (list, tuple)) or not v or not all(isinstance(c, str) and c for c in v):
        fail("a non-empty list of column names, or null (every column but the label)")
    return tuple(v)


@dataclass(frozen=True, config=STRICT)
class TaskConfig(Section):
    """The task every device's data must fit (docs/data.md): the label contract (class names in
    order: a class folder or label maps to its index here, never by what one device happens to
    hold), the per-sample input shape and how raw inputs are prepared. Agents receive it in the
    run description and check their data against it before registering."""

    REQUIRED: ClassVar[Mapping[str, str]] = {"classes": "the class names in label order",
                                             "input_shape": "the per-sample input shape"}

    classes: Annotated[tuple[str, ...], checked(_class_names)]
    input_shape: Annotated[tuple[int, ...], checked(_input_shape)]
    scale: Annotated[float, POSITIVE_NUMBER] = 255.0
    """Raw values are divided by it first (255 for 8-bit pixels; 1 for data already scaled)."""
    normalize: Annotated[Union[str, tuple[tuple[float, ...], tuple[float, ...]]], checked(_normalize)] = "federated"
    """Per-channel standardisation: 'federated' (from the devices' statistics, once, before round 1),
    'none', or given constants."""
    resize: Annotated[Optional[tuple[int, int]], checked(_resize)] = None
    """Resize images to this size (bilinear); null: an image of another size is an error."""
    label_column: Annotated[str, NONEMPTY_STRING] = "label"
    """Tables and Hugging Face data sets: the column holding the class name."""
    features: Annotated[Optional[tuple[str, ...]], checked(_names)] = None
    """Tables: the feature columns, in order; null: every column but the label."""

    @model_validator(mode="after")
    def _relations(self) -> "TaskConfig":
        if self.resize is not None and len(self.input_shape) != 3:
            raise invalid("resize", "resizing needs image inputs ([channels, height, width])")
        if self.resize is not None and tuple(self.resize) != tuple(self.input_shape[1:]):
            raise invalid("resize", f"expected the input_shape's size {list(self.input_shape[1:])}, "
                                    f"got {list(self.resize)}")
        if isinstance(self.normalize, tuple) and len(self.normalize[0]) != self.input_shape[0]:
            raise invalid("normalize", f"expected {self.input_shape[0]} means and stds (one per channel), "
                                       f"got {len(self.normalize[0])}")
        if self.features is not None and (len(self.input_shape) != 1 or len(self.features) != self.input_shape[0]):
            raise invalid("features", f"expected input_shape [{len(self.features)}] for {len(self.features)} "
                                      f"feature columns, got {list(self.input_shape)}")
        return self

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def to_wire(self) -> dict[str, Any]:
        """As the run description carries it (plain lists; ``task_from_wire`` reads it back)."""
        norm = self.normalize
        return {"classes": list(self.classes), "input_shape": list(self.input_shape), "scale": self.scale,
                "normalize": norm if isinstance(norm, str) else {"mean": list(norm[0]), "std": list(norm[1])},
                "resize": list(self.resize) if self.resize else None, "label_column": self.label_column,
                "features": list(self.features) if self.features else None}


def task_from_wire(d: Any, source: str = "run_info.task") -> TaskConfig:
    """A task as a run description carries it, validated like the run config's ``task:``."""
    return validate(TaskConfig, d, source)


@dataclass(frozen=True, config=STRICT)
class EvalConfig(Section):
    """Where the global model is scored (docs/data.md): the server's own validation data, and
    the devices' held-out splits (federated evaluation)."""

    data: Annotated[Optional[str], checked(_data_path)] = None
    """The server's validation data, in any format agents read (needs ``task``); relative to the run file."""
    federated_every: Annotated[int, NONNEG_INTEGER] = 0
    """Every k rounds, the round's agents score the global model on their held-out split (0: never)."""

    @field_validator("data")
    @classmethod
    def _anchor(cls, v: Optional[str], info: ValidationInfo) -> Optional[str]:
        return _anchored(v, info)


def _parsed(kind: Any, what: str) -> Conv:
    """A defense's settings through its own ``parse`` (the agent flags' and the run config's
    forms alike); ``null`` = off."""
    def conv(v: Any, fail: Fail) -> Any:
        if v is None:
            return None
        try:
            return kind.parse(dict(v) if isinstance(v, Mapping) else v)
        except ValueError:
            fail(what)
            raise
    return conv


@dataclass(frozen=True, config=STRICT)
class PrivacyConfig(Section):
    """Defenses the agents apply to what they send (:mod:`sfl_core.privacy`). A simulation applies
    them to its in-process agents; a deployed agent takes them from its own ``sfl-agent start``
    flags (the device owner decides, and the coordinator needs to know nothing)."""

    nopeek: Annotated[float, checked(nonneg_number)] = 0.0
    activation_noise: Annotated[Optional[ActivationNoise], checked(_parsed(
        ActivationNoise, 'null, {clip: number > 0, sigma: number >= 0} or "CLIP,SIGMA"'))] = None
    withhold_labels: Annotated[bool, BOOLEAN] = False
    """Agents send no labels: the coordinator returns their rows' logits (MergeSFL)."""
    label_protection: Annotated[Optional[LabelProtection], checked(_parsed(
        LabelProtection, "null, max_norm, a number >= 0 (sigma) or {sigma: number >= 0}"))] = None
    """Noise on the logit gradients agents return (needs withhold_labels)."""
    dp_sgd: Annotated[Optional[DpSgd], checked(_parsed(
        DpSgd, 'null, {clip: number > 0, sigma: number > 0, delta: number in (0, 1)} or "CLIP,SIGMA[,DELTA]"'))] = None
    """DP-SGD on the client portion; epsilon (Opacus's accountant) is recorded per round."""

    @model_validator(mode="after")
    def _relations(self) -> "PrivacyConfig":
        try:
            self.agent()
        except ValueError as exc:
            raise invalid("label_protection" if self.label_protection is not None and not self.withhold_labels
                          else "dp_sgd", str(exc))
        if self.dp_sgd is not None:
            try:
                require_accountant()
            except RuntimeError as exc:
                raise invalid("dp_sgd", str(exc))
        return self

    def agent(self) -> AgentPrivacy:
        return AgentPrivacy(self.nopeek, self.activation_noise, withhold_labels=self.withhold_labels,
                            label_protection=self.label_protection, dp_sgd=self.dp_sgd)
