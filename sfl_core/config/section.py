"""The base of a method's own run-config section (``s2fl:``, ``hetero:``, ``mergesfl:``, ``auto:``),
and of a training option's (``drift:``, ``norm_stats:``: :class:`OptionSection`).

A method that has settings of its own declares them in its folder
(``sfl_core/methods/<method>/config.py``) as a frozen pydantic dataclass deriving from
:class:`MethodSection`, and registers it under its YAML key
(:func:`sfl_core.method_registry.register_section`). The run config then accepts that key,
validates it with the same one-line errors as every core key, fills in its defaults when the
file leaves it out, documents it in the generated reference (from :attr:`MethodSection.DOCS`)
and hands it back as ``cfg.sections[KEY]`` (:meth:`MethodSection.of`). The section also checks
its relations with the core keys (:meth:`MethodSection.check_run`): each method validates its
own arguments, as each strategy of Flower does in its constructor.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, ClassVar, Mapping, TypeVar

from sfl_core.config.fields import Section

if TYPE_CHECKING:
    from sfl_core.config.run import RunConfig

S = TypeVar("S", bound="MethodSection")


class MethodSection(Section):
    """A method's section of the run config.

    Class attributes:
        KEY: its YAML key (``s2fl``); a run config reads ``cfg.sections[KEY]``.
        DOCS: ``(key, meaning)`` pairs for the reference, ``""`` for the section itself first.
    """

    KEY: ClassVar[str] = ""
    DOCS: ClassVar[tuple[tuple[str, str], ...]] = ()
    ALIASES: ClassVar[Mapping[str, str]] = {}
    """Top-level YAML keys the section also reads, each as one of its fields (a key that was a
    core key before the section existed: run files keep working)."""

    @classmethod
    def of(cls: type[S], run: "RunConfig") -> S:
        """This section of ``run`` (its defaults where the file has none)."""
        return run.sections[cls.KEY]

    def check_run(self, run: "RunConfig") -> None:
        """Relations with the run's core keys, once the whole run config is read: raise
        ``sfl_core.config.fields.invalid("<key>.<field>", message)`` for the first one broken."""
        return None

    def replace_in(self, run: "RunConfig", **changes: Any) -> "RunConfig":
        """``run`` with this section's ``changes`` (validated as a file's would be)."""
        changed = dataclasses.replace(self, **changes)  # type: ignore[type-var]  # a pydantic dataclass
        return dataclasses.replace(run, sections={**run.sections, self.KEY: changed})

    def neutral(self: S) -> S:
        """This section with the method's own switches off (the common ground ``sfl-coord plan``
        compares the methods from)."""
        return self


class OptionSection(MethodSection):
    """A training option's section of the run config (``drift:``, ``norm_stats:``, ...): the same
    machinery as a method's, registered in :mod:`sfl_core.option_registry` and read with
    ``OptionClass.of(cfg)``; ``neutral`` is the option off."""
