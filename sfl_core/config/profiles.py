"""Device profiles: what the time model knows about one kind of device (compute, links, memory,
a capacity schedule), read from ``profiles/devices/*.yaml`` or sent by a registering agent,
and where the shipped profiles are found."""

from __future__ import annotations

import difflib
import importlib.util
import os
from dataclasses import fields, replace
from pathlib import Path
from typing import Any, ClassVar, Mapping, Optional, Sequence

from pydantic.dataclasses import dataclass
from typing_extensions import Annotated  # typing.Annotated needs Python 3.9

from sfl_core.config.fields import (
    STRICT,
    YAML_SUFFIXES,
    ConfigError,
    Fail,
    Section,
    checked,
    looks_like_path,
    number,
    read_yaml,
    validate,
)
from sfl_core.config.values import (
    BOOLEAN,
    NONEMPTY_STRING,
    OPTIONAL_POSITIVE_NUMBER,
    POSITIVE_NUMBER,
    nonneg_number,
)


MAX_CAPACITY_CHANGES = 1000
"""Most entries of a profile's ``capacity`` schedule (a received profile is bounded too)."""


def _text(v: Any, fail: Fail) -> str:
    """Free text (descriptions); empty is fine, but a number or list is a mistake."""
    if v is None:
        return ""
    if not isinstance(v, str):
        fail("a string")
    return v

def _capacity(v: Any, fail: Fail) -> tuple[tuple[int, float, float], ...]:
    """A profile file writes ``{from_round, compute, link}`` entries; a registration (and an older
    checkpoint) sends ``[from_round, compute, link]`` triples. Both mean the same schedule."""
    what = ("a list of {from_round: R >= 1, compute: scale > 0, link: scale > 0} with rounds ascending")
    if v is None:
        return ()
    if not isinstance(v, (list, tuple)) or len(v) > MAX_CAPACITY_CHANGES:
        fail(what)
    out = []
    for e in v:
        if isinstance(e, (list, tuple)) and len(e) == 3:
            e = {"from_round": e[0], "compute": e[1], "link": e[2]}
        if not isinstance(e, dict) or set(e) - {"from_round", "compute", "link"} or "from_round" not in e:
            fail(what)
        r, c, k = e["from_round"], number(e.get("compute", 1.0)), number(e.get("link", 1.0))
        if not isinstance(r, int) or isinstance(r, bool) or r < 1 or c is None or k is None or c <= 0 or k <= 0:
            fail(what)
        out.append((r, float(c), float(k)))
    if any(b[0] <= a[0] for a, b in zip(out, out[1:])):
        fail(what)
    return tuple(out)

# ------------------------------------------------------------------------ device profiles


def capacity_scales(capacity: Sequence[Sequence[float]], r: int) -> tuple[float, float]:
    """(compute, link) scale in force in round ``r`` under a capacity schedule (1, 1 before any)."""
    compute, link = 1.0, 1.0
    for from_round, c, k in capacity:
        if r >= from_round:
            compute, link = float(c), float(k)
    return compute, link


@dataclass(frozen=True, config=STRICT)
class DeviceProfile(Section):
    """What the timing model (docs/methods/time-model.md) needs to know about one kind of device: read from
    a profile file, and the same type once an agent has registered it with the coordinator."""

    REQUIRED: ClassVar[Mapping[str, str]] = {"compute_flops": "a positive number",
                                             "link_bytes_per_s": "a positive number",
                                             "name": "a non-empty string"}

    name: Annotated[str, NONEMPTY_STRING]
    compute_flops: Annotated[float, POSITIVE_NUMBER]  # sustained FLOP/s for training (fp32)
    link_bytes_per_s: Annotated[float, POSITIVE_NUMBER]  # uplink rate, bytes/s
    downlink_bytes_per_s: Annotated[Optional[float], OPTIONAL_POSITIVE_NUMBER] = None  # None -> link_bytes_per_s
    latency_s: Annotated[float, checked(nonneg_number)] = 0.0  # one-way latency
    half_duplex: Annotated[bool, BOOLEAN] = False
    """Uploads and downloads share one medium and take turns (a WiFi cell), so steps in flight
    cannot overlap the activations going up with the gradients coming down
    (:func:`sfl_core.timing.pipelined_step_s`); False: a full-duplex link (Ethernet, cellular)."""
    bidir_link_bytes_per_s: Annotated[Optional[float], OPTIONAL_POSITIVE_NUMBER] = None
    bidir_downlink_bytes_per_s: Annotated[Optional[float], OPTIONAL_POSITIVE_NUMBER] = None
    """A full-duplex link's uplink and downlink rates while both directions carry data at once
    (``iperf3 --bidir``; None: the one-way rate). Each direction's segments and acknowledgements
    queue behind the other's, so a link both ways busy moves less each way; steps in flight keep
    it so (:func:`sfl_core.timing.pipelined_step_s`)."""
    memory_bytes: Annotated[Optional[float], OPTIONAL_POSITIVE_NUMBER] = None
    description: Annotated[str, checked(_text)] = ""
    source: Annotated[str, checked(_text)] = ""  # where the numbers come from
    capacity: Annotated[tuple[tuple[int, float, float], ...], checked(_capacity)] = ()
    """Capacity that changes over time, for emulation and simulation: ``(from_round, compute
    scale, link scale)`` entries, ascending; from that round on the device runs at the scaled
    FLOP/s and link rates (e.g. thermal throttling, a congested link)."""

    def __post_init__(self) -> None:
        # Most links are quoted as one number; a symmetric link is the honest default.
        if self.downlink_bytes_per_s is None:
            object.__setattr__(self, "downlink_bytes_per_s", self.link_bytes_per_s)

    @property
    def downlink(self) -> float:
        """The downlink rate as a float (``downlink_bytes_per_s`` is never None after init)."""
        return float(self.downlink_bytes_per_s or self.link_bytes_per_s)

    @property
    def both_ways(self) -> tuple[float, float]:
        """The share of its one-way rate the uplink and the downlink each keep while both carry
        data at once (1 where the profile does not say, and at most 1)."""
        up, down = self.bidir_link_bytes_per_s, self.bidir_downlink_bytes_per_s
        return (min(1.0, up / self.link_bytes_per_s) if up else 1.0,
                min(1.0, down / self.downlink) if down else 1.0)

    def at_round(self, r: int) -> "DeviceProfile":
        """This profile as the device runs in round ``r`` (the latest capacity change in force)."""
        compute, link = capacity_scales(self.capacity, r)
        if (compute, link) == (1.0, 1.0):
            return self
        bidir = {k: getattr(self, k) * link for k in ("bidir_link_bytes_per_s", "bidir_downlink_bytes_per_s")
                 if getattr(self, k)}
        return replace(self, compute_flops=self.compute_flops * compute, link_bytes_per_s=self.link_bytes_per_s * link,
                       downlink_bytes_per_s=self.downlink * link, **bidir)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (msgpack/YAML friendly); ``profile_from_dict`` reads it back."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["capacity"] = [{"from_round": r, "compute": c, "link": lk} for r, c, lk in self.capacity]
        return d

# ------------------------------------------------------------------------ loading

_CHECKOUT_PROFILES = Path(__file__).resolve().parents[2] / "profiles"
_PROFILES_PACKAGE = "sfl_profiles"  # profiles/ as the wheel ships it (pyproject.toml)


def _profiles_dir_and_origin() -> tuple[Path, str]:
    env = os.environ.get("SFL_PROFILES_DIR")
    if env:
        return Path(env), "SFL_PROFILES_DIR"
    if _CHECKOUT_PROFILES.is_dir() and (_CHECKOUT_PROFILES.parent / "pyproject.toml").is_file():
        return _CHECKOUT_PROFILES, "source checkout"   # the folder users edit wins over any installed copy
    spec = importlib.util.find_spec(_PROFILES_PACKAGE)   # not importlib.resources.files: Python 3.8 lacks it
    if spec is None or spec.origin is None:
        return _CHECKOUT_PROFILES, "not found"
    return Path(spec.origin).parent, f"installed package {_PROFILES_PACKAGE}"


def default_profiles_dir() -> Path:
    """Where device profiles (``devices/``) and run configs (``runs/``) are read from.

    ``SFL_PROFILES_DIR`` if set (the install scripts' systemd units set it); else the
    checkout's ``profiles/`` when running from a source tree (editable installs too); else the
    copy shipped inside the installed package (``sfl_profiles``, found by ``importlib.util.find_spec``).
    """
    return _profiles_dir_and_origin()[0]


def profiles_origin() -> str:
    """Why :func:`default_profiles_dir` is what it is, for messages: 'SFL_PROFILES_DIR', 'source
    checkout', 'installed package sfl_profiles' or 'not found'."""
    return _profiles_dir_and_origin()[1]


def _search_dirs(search_dirs: Sequence[Path] | None) -> list[Path]:
    if search_dirs is None:
        return [default_profiles_dir() / "devices"]
    return [Path(d) for d in search_dirs]


def list_profiles(search_dirs: Sequence[Path] | None = None) -> list[str]:
    """Names of the profiles found in ``search_dirs`` (file stems), sorted, without repeats."""
    names: set[str] = set()
    for d in _search_dirs(search_dirs):
        if d.is_dir():
            names.update(p.stem for p in d.iterdir() if p.suffix in YAML_SUFFIXES and p.is_file())
    return sorted(names)


def load_profile(name_or_path: str, search_dirs: Sequence[Path] | None = None) -> DeviceProfile:
    """A YAML path, or a name looked up as ``<dir>/<name>.yaml`` (first dir that has it wins)."""
    if not isinstance(name_or_path, str) or not name_or_path:
        raise ConfigError(f"<profile>: expected a profile name or path, got {name_or_path!r}")
    if looks_like_path(name_or_path):
        path = Path(name_or_path)
        return profile_from_dict(read_yaml(path), str(path), default_name=path.stem)
    dirs = _search_dirs(search_dirs)
    for d in dirs:
        for suffix in YAML_SUFFIXES:
            path = d / f"{name_or_path}{suffix}"
            if path.is_file():
                prof = profile_from_dict(read_yaml(path), str(path), default_name=name_or_path)
                if prof.name != name_or_path:
                    # Otherwise a fleet entry 'jetson-nano' could silently become another device.
                    raise ConfigError(f"{path}: field 'name': expected {name_or_path!r} "
                                      f"(the file name), got {prof.name!r}")
                return prof
    available = list_profiles(dirs)
    close = difflib.get_close_matches(name_or_path, available, n=1)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    raise ConfigError(
        f"{name_or_path}: unknown device profile{hint} (looked in "
        f"{', '.join(str(d) for d in dirs)}; available: {', '.join(available) or 'none'})"
    )


def profile_from_dict(d: Any, source: str = "<dict>", default_name: str | None = None) -> DeviceProfile:
    """Validate a profile mapping (a YAML file's content, one sent by an agent, or a checkpoint's)."""
    if isinstance(d, Mapping) and "name" not in d and default_name is not None:
        d = {**d, "name": default_name}
    return validate(DeviceProfile, d, source)
