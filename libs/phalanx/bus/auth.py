"""How a client logs in to the NATS server: credentials, TLS, the inbox its replies use.

Every option comes from the settings (``PHALANX_NATS_USER``, ``PHALANX_NATS_TLS_*``...), read
by :func:`nats_auth_options` for :meth:`phalanx.bus.Bus.connect`.
"""

from __future__ import annotations

import re
import ssl
from typing import Any
from urllib.parse import urlsplit

from phalanx.contract.permissions import inbox_prefix
from phalanx.settings import NatsSettings, load


def nats_url() -> str:
    """The server URL from ``NATS_URL`` (or ``PHALANX_NATS_URL``)."""
    return load(NatsSettings).nats_url


# NATS server authorization (roles and permissions: phalanx.natsauth).
ENV_NATS_USER = "PHALANX_NATS_USER"
ENV_NATS_PASSWORD = "PHALANX_NATS_PASSWORD"
# TLS (any of these, or a tls:// URL, turns it on): the CA that signed the server's
# certificate (default: the system's), this client's certificate and key (for a
# server that verifies clients), and the name to check the server's certificate for.
ENV_NATS_TLS_CA = "PHALANX_NATS_TLS_CA"
ENV_NATS_TLS_CERT = "PHALANX_NATS_TLS_CERT"
ENV_NATS_TLS_KEY = "PHALANX_NATS_TLS_KEY"
ENV_NATS_TLS_HOSTNAME = "PHALANX_NATS_TLS_HOSTNAME"
# nats.py hands error_cb the server's -ERR text lower-cased, subject included.
PERMISSION_VIOLATION = re.compile(r'permissions violation for (publish|subscription) to "([^"]+)"')


class PermissionDenied(RuntimeError):
    """The NATS server refused this client's credentials, or a publish it made."""


def nats_auth_options(url: str) -> dict[str, Any]:
    """Client options for an authorizing and/or TLS server: none when nothing is set.

    ``PHALANX_NATS_USER`` / ``PHALANX_NATS_PASSWORD`` win over a
    ``nats://user:pass@host:port`` URL (which works too, but URLs end up in logs).

    TLS is on when a server URL is ``tls://...`` or any of ``PHALANX_NATS_TLS_CA``
    (a PEM bundle of the CAs to trust instead of the system's), ``PHALANX_NATS_TLS_CERT``
    and ``PHALANX_NATS_TLS_KEY`` (this client's certificate chain and key, for a
    server that verifies clients) is set; ``PHALANX_NATS_TLS_HOSTNAME`` names the
    host the server's certificate must be for (default: the URL's host). The
    server's certificate is always verified.
    """
    settings = load(NatsSettings)
    user = settings.nats_user
    opts: dict[str, Any] = {}
    if user:
        opts.update(user=user, password=settings.nats_password.get_secret_value())
    else:
        user = urlsplit(url.split(",")[0].strip()).username
    if user:
        opts["inbox_prefix"] = inbox_prefix(user)
    ca, cert, key = settings.nats_tls_ca, settings.nats_tls_cert, settings.nats_tls_key
    tls_url = any(u.strip().lower().startswith("tls://") for u in url.split(","))
    if tls_url or ca or cert or key:
        if key and not cert:
            raise ValueError(f"{ENV_NATS_TLS_KEY} is set without {ENV_NATS_TLS_CERT}")
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca)
        if cert:
            context.load_cert_chain(cert, key)
        opts["tls"] = context
        if settings.nats_tls_hostname:
            opts["tls_hostname"] = settings.nats_tls_hostname
    return opts
