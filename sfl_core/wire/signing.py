"""Whom an agent obeys: the coordinator's Ed25519 signature on what steers an agent.

Problem: an agent learns what to train from the run description retained on the broker and
from per-round assignments on its down topic. On a broker without per-topic ACLs anyone
connected can publish there, and a forged description (another model, partition or
strategy) would make every agent swap its work.

Trust model (docs/protocol.md §2.1):

- each coordinator run has an Ed25519 key pair (kept in the run's output directory, or given
  with ``sfl-coord serve --signing-key``); its public key travels in ``run_info.coordinator``;
- the coordinator signs ``run_info``, ``assign`` and ``shutdown``: the signature covers the
  whole envelope (type, run, sender, seq, round, step and body without ``sig``), so a signed
  message cannot be replayed under another round or altered;
- a signed message to one agent names it (``body.to``) where the agent said it checks that
  (:data:`ADDRESSED` in its registration's ``features``), and such an agent refuses a signed
  message that names another (:func:`misaddressed`). Without the name, one agent's signed
  assignment, read off the broker and published on another's topic after that one's own
  assignment of the round, passed as a restarted round: that agent trained the other's cut,
  batch and server worker, and dropped out of the round. A message that names nobody is still
  followed: a coordinator of an older version names nobody, and nor does this one an agent it
  does not know to check (an older agent refuses a field it does not know), so a fleet mixing
  versions can still have an older agent's assignment replayed to a newer one;
- an agent trusts one key per run, and that trust comes from outside the broker: the key given
  at install or start (``--coordinator-key``, as ``sfl-coord broker-config`` issues it with the
  device's credentials), or the one pinned in its trust file (``--trust-file``) by an earlier
  start. Trust on first use (the first signed description seen is believed and pinned) only
  with ``--trust-first-use``, which the agent refuses on a broker that does not authenticate
  devices: there anyone could publish the first description, and an attacker's retained copy
  published before the agent's first start would be pinned instead of the coordinator's.
  A description signed by another key, or unsigned, is refused with one WARNING line; so is
  an assignment or a shutdown that the trusted key did not sign.

Why Ed25519 (via ``cryptography``): 32-byte keys that fit on one line of a config file,
deterministic signatures, and tens of microseconds per message.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from pathlib import Path
from typing import Any, Optional

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from sfl_core.wire import codec as wire

_CORE_SIGNED = frozenset({"run_info", "assign", "evaluate", "shutdown"})


def __getattr__(name: str) -> Any:
    """``SIGNED_TYPES``: coordinator messages that change what an agent does, the core's and the
    training options' requests (:mod:`sfl_core.option_registry`); an agent follows them only
    when signed."""
    if name != "SIGNED_TYPES":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from sfl_core.wire import protocol   # the options' messages are read on first use
    value = globals()[name] = _CORE_SIGNED | protocol.OPTION_COORD_TYPES   # read once
    return value
ADDRESSED = "addressed"
"""What an agent puts in ``register.features`` to be sent signed messages that name it (``body.to``)."""
KEY_FILE = "coordinator.key"
PUBLIC_FILE = "coordinator.pub"


class TrustError(ValueError):
    """A key file or a trust file that cannot be used; the message names it."""


def _signed_bytes(msg: Any) -> bytes:
    body = {k: v for k, v in msg.body.items() if k != "sig"}
    return wire.pack({"v": wire.PROTOCOL_VERSION, "type": msg.type, "run": msg.run, "sender": msg.sender,
                      "seq": msg.seq, "round": msg.round, "step": msg.step, "body": body})


def public_text(key: bytes) -> str:
    """A public key as agents' configs write it: 44 characters of base64."""
    return base64.b64encode(key).decode()


def parse_public(text: str, where: str) -> bytes:
    """A public key from base64 text or from a file holding it; TrustError naming ``where``."""
    value = text.strip()
    path = Path(value)
    if len(value) != 44 and path.is_file():
        try:
            value = path.read_text().strip()
        except OSError as exc:
            raise TrustError(f"{where}: cannot read {path} ({exc.strerror})") from None
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raw = b""
    if len(raw) != 32:
        raise TrustError(f"{where}: expected a coordinator public key (44 characters of base64, as in "
                         f"coordinator.pub) or a file holding one, got {text!r}")
    return raw


class Signer:
    """The coordinator's private key."""

    def __init__(self, key: Ed25519PrivateKey):
        self._key = key
        self.public = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)

    @classmethod
    def generate(cls) -> "Signer":
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def load_or_create(cls, path: Path) -> "Signer":
        """The key in ``path`` (PEM, PKCS#8); a new one written there (mode 0600) if it is missing,
        with its public half beside it (``.pub``)."""
        if path.exists():
            try:
                key = serialization.load_pem_private_key(path.read_bytes(), password=None)
            except (OSError, ValueError, TypeError) as exc:
                raise TrustError(f"{path}: not an unencrypted PEM private key ({type(exc).__name__})") from None
            if not isinstance(key, Ed25519PrivateKey):
                raise TrustError(f"{path}: not an Ed25519 key")
            return cls(key)
        signer = cls.generate()
        path.parent.mkdir(parents=True, exist_ok=True)
        pem = signer._key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                        serialization.NoEncryption())
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(pem)
        path.with_suffix(".pub").write_text(public_text(signer.public) + "\n")
        return signer

    def sign(self, msg: Any) -> Any:
        """``msg`` with ``body.sig`` set (the message is changed in place and returned)."""
        msg.body.pop("sig", None)
        msg.body["sig"] = self._key.sign(_signed_bytes(msg))
        return msg


def misaddressed(msg: Any, agent_id: str) -> Optional[str]:
    """Why a signed message is not ``agent_id``'s (it names another agent), or None. The name is
    inside the signature, so nobody but the coordinator can set or change it."""
    to = msg.body.get("to")
    return None if to is None or to == agent_id else f"it is addressed to {to!r}, not to {agent_id!r}"


def verify(msg: Any, public: bytes) -> bool:
    """Whether ``msg`` carries a valid signature by ``public``."""
    sig = msg.body.get("sig")
    if not isinstance(sig, bytes) or len(sig) != 64:
        return False
    try:
        Ed25519PublicKey.from_public_bytes(public).verify(sig, _signed_bytes(msg))
    except (InvalidSignature, ValueError):
        return False
    return True


class Trust:
    """The key an agent follows for its run: explicit, pinned in a trust file, or (only with
    ``first_use``) the first one seen.

    ``decide(run, key)`` returns None when ``key`` is trusted (pinning it on first use), else
    the reason it is not.
    """

    def __init__(self, explicit: Optional[bytes] = None, trust_file: Optional[Path] = None,
                 first_use: bool = False):
        self.explicit = explicit
        self.trust_file = trust_file
        self.first_use = first_use
        self._pinned: dict[str, bytes] = {}
        if trust_file is not None and trust_file.exists():
            try:
                doc = json.loads(trust_file.read_text() or "{}")
                if not isinstance(doc, dict):
                    raise ValueError("not a mapping")
                self._pinned = {str(r): parse_public(str(k), f"{trust_file}: run {r}") for r, k in doc.items()}
            except (OSError, ValueError) as exc:
                raise TrustError(f"{trust_file}: not a trust file of run ids to coordinator keys ({exc})") from None

    def pinned(self, run: str) -> Optional[bytes]:
        return self.explicit if self.explicit is not None else self._pinned.get(run)

    def decide(self, run: str, key: bytes) -> Optional[str]:
        trusted = self.pinned(run)
        if trusted is None and not self.first_use:
            return (f"signed by coordinator key {public_text(key)}, but no key is trusted for this run "
                    f"(give --coordinator-key, or --trust-first-use on a broker that authenticates devices)")
        if trusted is None:
            self._pinned[run] = key
            if self.trust_file is not None:
                self._save()
            return None
        if key == trusted:
            return None
        source = "--coordinator-key" if self.explicit is not None else (
            str(self.trust_file) if self.trust_file is not None else "the key first seen by this process")
        return f"signed by coordinator key {public_text(key)}, not the trusted {public_text(trusted)} ({source})"

    def _save(self) -> None:
        assert self.trust_file is not None
        self.trust_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.trust_file.with_name(self.trust_file.name + ".tmp")
        tmp.write_text(json.dumps({r: public_text(k) for r, k in sorted(self._pinned.items())}, indent=1) + "\n")
        os.replace(tmp, self.trust_file)
