"""Parse MQTT broker URLs given on the command line or in env files.

Pure (no network I/O) so the CLI can reject a malformed ``--broker`` before it
tries to connect, and so the password never leaks into logs: ``url()`` omits it.

Accepted forms::

    mqtt://host[:1883]          plain TCP (also ``tcp://``)
    mqtts://host[:8883]         TLS (also ``ssl://``, ``tls://``)
    mqtt://user:pass@host:1883  credentials (percent-encoded if they contain ':' or '@')
    host:port  /  host          bare form, plain TCP
    mqtt://[::1]:1883           IPv6 literals in brackets
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from urllib.parse import unquote, urlsplit

__all__ = ["BrokerAddress", "TlsFiles", "parse_broker_url", "secure", "DEFAULT_PORT", "DEFAULT_TLS_PORT"]

DEFAULT_PORT = 1883
DEFAULT_TLS_PORT = 8883

_PLAIN_SCHEMES = {"mqtt", "tcp"}
_TLS_SCHEMES = {"mqtts", "ssl", "tls"}


@dataclass(frozen=True)
class TlsFiles:
    """PEM files for an ``mqtts://`` connection.

    ``ca_file`` is the authority that signed the broker's certificate (None: the system's
    trust store); the broker's certificate and host name are always verified. ``cert_file``
    and ``key_file`` are this client's own certificate, for brokers that require one.
    """

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None

    def __bool__(self) -> bool:
        return any((self.ca_file, self.cert_file, self.key_file))


@dataclass(frozen=True)
class BrokerAddress:
    """Where an MQTT broker lives and how to log in to it."""

    host: str
    port: int
    tls: bool = False
    username: str | None = None
    password: str | None = None
    tls_files: TlsFiles = TlsFiles()

    def url(self) -> str:
        """Canonical URL, safe to print: the password is never included."""
        scheme = "mqtts" if self.tls else "mqtt"
        host = f"[{self.host}]" if ":" in self.host else self.host
        user = f"{self.username}@" if self.username else ""
        return f"{scheme}://{user}{host}:{self.port}"

    def __repr__(self) -> str:  # keep passwords out of tracebacks and logs
        pw = "***" if self.password else None
        return (f"BrokerAddress(host={self.host!r}, port={self.port}, tls={self.tls}, "
                f"username={self.username!r}, password={pw!r}, tls_files={self.tls_files!r})")

    __str__ = url


def secure(address: BrokerAddress, *, tls_files: TlsFiles = TlsFiles(),
           password: str | None = None) -> BrokerAddress:
    """``address`` with TLS files and a password (e.g. read from a file, so it never sits in a
    command line that ``ps`` shows). ValueError when the combination cannot work."""
    if tls_files and not address.tls:
        raise ValueError(f"TLS files given for {address.url()}: use an mqtts:// URL to connect with TLS")
    if bool(tls_files.cert_file) != bool(tls_files.key_file):
        raise ValueError("a client certificate needs both --cert-file and --key-file")
    if password is not None and not address.username:
        raise ValueError(f"a password was given but {address.url()} names no user (mqtts://USER@host:8883)")
    return replace(address, tls_files=tls_files,
                   password=password if password is not None else address.password)


def parse_broker_url(url: str) -> BrokerAddress:
    """Parse ``url`` into a :class:`BrokerAddress`; ValueError explains what is wrong."""
    if not isinstance(url, str) or not url.strip():
        raise ValueError("empty MQTT broker URL; expected e.g. mqtt://host:1883")
    text = url.strip()
    if "://" not in text:
        text = "mqtt://" + text  # bare "host" or "host:port"
    parts = urlsplit(text)
    scheme = parts.scheme.lower()
    if scheme in _PLAIN_SCHEMES:
        tls = False
    elif scheme in _TLS_SCHEMES:
        tls = True
    else:
        raise ValueError(
            f"unsupported MQTT broker URL scheme {parts.scheme!r} in {url!r}; "
            "use mqtt://host:1883 or mqtts://host:8883")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"MQTT broker URL {url!r} must not contain a path, query or fragment")
    try:
        port = parts.port
    except ValueError as exc:  # non-numeric or out of range
        raise ValueError(f"invalid port in MQTT broker URL {url!r}: {exc}") from None
    host = parts.hostname
    if not host:
        raise ValueError(f"missing host in MQTT broker URL {url!r}; expected e.g. mqtt://host:1883")
    if port is None:
        port = DEFAULT_TLS_PORT if tls else DEFAULT_PORT
    elif port == 0:
        raise ValueError(f"invalid port 0 in MQTT broker URL {url!r}")
    username = unquote(parts.username) if parts.username else None
    password = unquote(parts.password) if parts.password is not None else None
    if password is not None and not username:
        raise ValueError(f"MQTT broker URL {url!r} has a password but no user name")
    return BrokerAddress(host=host, port=port, tls=tls, username=username, password=password)
