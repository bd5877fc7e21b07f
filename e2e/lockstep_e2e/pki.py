"""Certificates and keys for the local control plane (a throwaway CA on loopback)."""

from __future__ import annotations

import base64
import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_VALIDITY = dt.timedelta(days=2)


@dataclass(frozen=True)
class KeyPair:
    cert: Path
    key: Path


def _new_key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def _write_key(key: rsa.RSAPrivateKey, path: Path) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption()
        )
    )
    path.chmod(0o600)


def _name(common_name: str, organization: str | None = None) -> x509.Name:
    attributes = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    if organization:
        attributes.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization))
    return x509.Name(attributes)


class CertificateAuthority:
    """A CA that issues the serving and client certificates of one local cluster (or of one component): its
    certificates are valid for ``validity``; its own names ``common_name`` (its subject and its DNS name)."""

    def __init__(
        self, directory: Path, common_name: str = "lockstep-local-ca", validity: dt.timedelta = _VALIDITY
    ) -> None:
        self.directory = directory
        self.validity = validity
        self._key = _new_key()
        now = dt.datetime.now(dt.UTC)
        self._cert = (
            x509.CertificateBuilder()
            .subject_name(_name(common_name))
            .issuer_name(_name(common_name))
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + validity)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(common_name)]), critical=False)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    key_cert_sign=True,
                    crl_sign=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(self._key, hashes.SHA256())
        )
        self.pair = KeyPair(directory / "ca.crt", directory / "ca.key")
        self.pair.cert.write_bytes(self._cert.public_bytes(serialization.Encoding.PEM))
        _write_key(self._key, self.pair.key)

    def issue(
        self,
        name: str,
        common_name: str,
        organization: str | None = None,
        *,
        server_hosts: tuple[str, ...] = (),
    ) -> KeyPair:
        """Issue a client certificate, or a serving one when ``server_hosts`` is given."""
        key = _new_key()
        now = dt.datetime.now(dt.UTC)
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server_hosts else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(common_name, organization))
            .issuer_name(self._cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + self.validity)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        )
        if server_hosts:
            builder = builder.add_extension(x509.SubjectAlternativeName(_alt_names(server_hosts)), critical=False)
        cert = builder.sign(self._key, hashes.SHA256())
        pair = KeyPair(self.directory / f"{name}.crt", self.directory / f"{name}.key")
        pair.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(key, pair.key)
        return pair


def _alt_names(hosts: tuple[str, ...]) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return names


def write_signing_key(directory: Path) -> KeyPair:
    """An RSA key pair for service-account tokens: ``cert`` holds the public key."""
    key = _new_key()
    pair = KeyPair(directory / "sa.pub", directory / "sa.key")
    _write_key(key, pair.key)
    pair.cert.write_bytes(
        key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    return pair


WEBHOOK_CERTIFICATE_VALIDITY = dt.timedelta(days=365)
"""Longer than controller-runtime's certificate rotator's 90-day lookahead, so that it keeps what it is given."""


@dataclass(frozen=True)
class WebhookCertificates:
    """What a controller whose internal certificate management rotates its webhooks' certificates is given first."""

    secret: dict[str, Any]
    """Its Secret, holding the CA and the serving certificate, as the rotator writes it."""
    cert_dir: Path
    """The same files where the kubelet would mount that Secret (the controller's webhook certDir)."""
    ca_bundle: str
    """The CA, base64, for the webhooks' clientConfig."""


def webhook_certificates(
    directory: Path, ca_name: str, namespace: str, service: str, secret: str
) -> WebhookCertificates:
    """A CA named ``ca_name`` (the name the controller's rotator checks its CA for) and a serving certificate valid for
    ``service``'s DNS name in ``namespace`` and for 127.0.0.1 (there is no Service network here: the API server calls
    the webhooks on loopback), both in ``secret`` and in ``directory``/certs."""
    directory.mkdir(parents=True, exist_ok=True)
    authority = CertificateAuthority(directory, common_name=ca_name, validity=WEBHOOK_CERTIFICATE_VALIDITY)
    serving = authority.issue("webhook", service, server_hosts=(f"{service}.{namespace}.svc", "127.0.0.1"))
    files = {
        "ca.crt": authority.pair.cert,
        "ca.key": authority.pair.key,
        "tls.crt": serving.cert,
        "tls.key": serving.key,
    }
    cert_dir = directory / "certs"
    cert_dir.mkdir(exist_ok=True)
    for key, path in files.items():
        (cert_dir / key).write_bytes(path.read_bytes())
    document = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": secret, "namespace": namespace},
        "data": {key: base64.b64encode(path.read_bytes()).decode() for key, path in files.items()},
    }
    return WebhookCertificates(document, cert_dir, base64.b64encode(authority.pair.cert.read_bytes()).decode())
