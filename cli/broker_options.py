"""The broker-security options of ``sfl-agent start`` and ``sfl-coord serve``, defined once.

Both sides connect to the same broker the same way (``mqtts://``, a private CA, an
optional client certificate, a password kept in a file), so the flags, their help and
their translation into a :class:`~sfl_core.transport.broker_url.BrokerAddress` live here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from typing_extensions import Annotated  # typing.Annotated needs Python 3.9

from sfl_core.transport.broker_url import BrokerAddress
from sfl_core.transport.mqtt_link import broker_address

__all__ = ["CaFile", "CertFile", "KeyFile", "PasswordFile", "address_from_options"]

CaFile = Annotated[Optional[Path], typer.Option(
    help="mqtts: CA certificate (PEM) that signed the broker's certificate. Default: the system trust store.")]
CertFile = Annotated[Optional[Path], typer.Option(
    help="mqtts: this client's certificate (PEM), if the broker requires one.")]
KeyFile = Annotated[Optional[Path], typer.Option(help="mqtts: the private key of --cert-file.")]
PasswordFile = Annotated[Optional[Path], typer.Option(
    help="File whose first line is the broker password (keeps it out of the command line).")]


def address_from_options(url: str, ca_file: Optional[Path], cert_file: Optional[Path], key_file: Optional[Path],
                         password_file: Optional[Path]) -> BrokerAddress:
    """ValueError (with the file or URL named) when the combination cannot work."""
    def s(p: Optional[Path]) -> Optional[str]:
        return None if p is None else str(p)
    return broker_address(url, ca_file=s(ca_file), cert_file=s(cert_file), key_file=s(key_file),
                          password_file=s(password_file))
