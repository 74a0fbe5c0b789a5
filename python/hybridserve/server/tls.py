"""HTTPS: the server's TLS context from `--ssl-certfile`, `--ssl-keyfile`, `--ssl-ca-certs` and
`--ssl-cert-reqs` (vLLM's flags, with uvicorn's meaning). Built before anything listens, so a
file that is missing or does not hold what its flag names stops the server with that flag's
name, not a handshake error later."""

from __future__ import annotations

import os
import ssl

# `--ssl-cert-reqs`: whether clients must show a certificate the `--ssl-ca-certs` authorities
# signed (Python's ssl.CERT_* numbers, as uvicorn takes them)
CERT_REQS = {0: ssl.CERT_NONE, 1: ssl.CERT_OPTIONAL, 2: ssl.CERT_REQUIRED}


class TLSConfigError(ValueError):
    """A TLS flag that cannot be used; the message names it."""


class _PassphraseAsked(Exception):
    pass


def _no_passphrase() -> str:
    raise _PassphraseAsked


def server_context(
    certfile: str | None, keyfile: str | None, ca_certs: str | None = None, cert_reqs: int = 0
) -> ssl.SSLContext | None:
    """The TLS context of a server with these flags, or None for plain HTTP (no certificate)."""
    if certfile is None and keyfile is None:
        if ca_certs is not None or cert_reqs:
            raise TLSConfigError("--ssl-ca-certs and --ssl-cert-reqs need --ssl-certfile and --ssl-keyfile")
        return None
    if certfile is None or keyfile is None:
        given, missing = (
            ("--ssl-certfile", "--ssl-keyfile") if keyfile is None else ("--ssl-keyfile", "--ssl-certfile")
        )
        raise TLSConfigError(f"{given} needs {missing} too (HTTPS takes the certificate and its private key)")
    if cert_reqs not in CERT_REQS:
        raise TLSConfigError(
            f"--ssl-cert-reqs must be 0 (none), 1 (optional) or 2 (required), got {cert_reqs}"
        )
    if cert_reqs and ca_certs is None:
        raise TLSConfigError(
            "--ssl-cert-reqs 1 or 2 needs --ssl-ca-certs (the authorities client certificates come from)"
        )
    for flag, path in (
        ("--ssl-certfile", certfile),
        ("--ssl-keyfile", keyfile),
        ("--ssl-ca-certs", ca_certs),
    ):
        if path is not None and not os.path.isfile(path):
            raise TLSConfigError(f"{flag} {path}: no such file")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        # (a key that needs a passphrase would make OpenSSL ask for it on the terminal)
        ctx.load_cert_chain(certfile, keyfile, password=_no_passphrase)
    except (ssl.SSLError, OSError, _PassphraseAsked) as e:
        why = (
            "the key needs a passphrase, which the server cannot ask for"
            if isinstance(e, _PassphraseAsked)
            else str(e)
        )
        raise TLSConfigError(
            f"--ssl-certfile {certfile} / --ssl-keyfile {keyfile}: not a PEM certificate and its private key ({why})"
        ) from None
    if ca_certs is not None:
        try:
            ctx.load_verify_locations(cafile=ca_certs)
        except (ssl.SSLError, OSError) as e:
            raise TLSConfigError(f"--ssl-ca-certs {ca_certs}: no PEM certificates in it ({e})") from None
    ctx.verify_mode = CERT_REQS[cert_reqs]
    return ctx
