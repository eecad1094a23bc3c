"""The ext_proc port's TLS: the configured certificate, or one made at start.

With `extproc.tls` the port serves that certificate (and requires Envoy's client certificate
when one is configured for mTLS). An endpoint picker without it still serves TLS, as the
gateways expect (they connect with TLS and do not verify the picker's certificate): a
self-signed certificate is made in memory at start, as the reference endpoint picker does.
With `endpoint_picker.client_ca_file` the picker verifies the gateway in turn: a client
without a certificate signed by that CA is refused in the TLS handshake.
"""

from __future__ import annotations

import datetime
import socket

import grpc

from extproc.config import TlsConfig

__all__ = ["configured_credentials", "self_signed_credentials"]

_VALID_FOR = datetime.timedelta(days=3650)  # a restart makes a new one; nobody pins it


def _read(path: str) -> bytes:
    with open(path, "rb") as file:
        return file.read()


def configured_credentials(
    tls: TlsConfig, client_ca_file: str | None = None
) -> grpc.ServerCredentials:
    """Blocking (reads files): run it off the event loop. Clients must present a certificate
    signed by `client_ca_file` when given, else by tls.ca_file under mTLS."""
    client_ca = client_ca_file or (tls.ca_file if tls.client_cert_file is not None else None)
    return grpc.ssl_server_credentials(
        [(_read(tls.key_file), _read(tls.cert_file))],
        root_certificates=_read(client_ca) if client_ca else None,
        require_client_auth=client_ca is not None,
    )


def self_signed_credentials(client_ca_file: str | None = None) -> grpc.ServerCredentials:
    """A fresh key and self-signed certificate (CPU-bound: run it off the event loop); clients
    must present a certificate signed by `client_ca_file` when given."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "pd-extproc endpoint picker")])
    now = datetime.datetime.now(datetime.UTC)
    names = [x509.DNSName("localhost"), x509.DNSName(socket.gethostname())]
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))  # clocks a little apart
        .not_valid_after(now + _VALID_FOR)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return grpc.ssl_server_credentials(
        [(key_pem, certificate.public_bytes(serialization.Encoding.PEM))],
        root_certificates=_read(client_ca_file) if client_ca_file else None,
        require_client_auth=client_ca_file is not None,
    )
