"""Self-managed TLS for the operator's two HTTPS servers: admission webhooks and the state API.

The CA outlives the operator process: runner pods carry it (FLOWKUBE_STATE_CA) for their whole
life and the webhook configurations carry it as caBundle, so an operator restart must not change
it. It is kept in a Secret (FLOWKUBE_TLS_SECRET, in a cluster) or in the cert directory (local
runs); the serving certificate is issued afresh at every start. No cert-manager is needed.
"""

from __future__ import annotations

import base64
import datetime as dt
import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from flowkube_operator.kube.client import ApiError, Kube, ns_path

CA_CERT, CA_KEY = "ca.crt", "ca.key"


@dataclass(frozen=True)
class CA:
    cert_pem: bytes
    key_pem: bytes


@dataclass(frozen=True)
class ServingTLS:
    ca_pem: bytes
    cafile: str
    certfile: str
    keyfile: str


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _key_usage(*, cert_sign: bool) -> x509.KeyUsage:
    # Strict verifiers (Python 3.13's default context sets VERIFY_X509_STRICT) require key usage and
    # key identifiers on both certificates.
    return x509.KeyUsage(digital_signature=not cert_sign, content_commitment=False, key_encipherment=False,
                         data_encipherment=False, key_agreement=False, key_cert_sign=cert_sign,
                         crl_sign=cert_sign, encipher_only=False, decipher_only=False)


def new_ca() -> CA:
    now = dt.datetime.now(dt.UTC)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "flowkube-ca")])
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=3650))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(_key_usage(cert_sign=True), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    return CA(cert.public_bytes(serialization.Encoding.PEM), _pem_key(key))


def serving_names(hosts: Iterable[str], service: str) -> list[x509.GeneralName]:
    """SANs: each host (IP or DNS name) and, in a cluster, the Service's DNS names."""
    names: list[x509.GeneralName] = []
    for host in dict.fromkeys(h for h in hosts if h):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    if service:
        ns, name = service.split("/", 1)
        names += [x509.DNSName(f"{name}.{ns}.svc"), x509.DNSName(f"{name}.{ns}.svc.cluster.local")]
    return names


def issue(ca: CA, cert_dir: str, hosts: Iterable[str], service: str) -> ServingTLS:
    """A fresh serving certificate signed by `ca`, written with the CA into cert_dir."""
    d = Path(cert_dir)
    d.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC)
    ca_cert = x509.load_pem_x509_certificate(ca.cert_pem)
    ca_key = serialization.load_pem_private_key(ca.key_pem, password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise ValueError("the flowkube CA key must be an EC key")
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "flowkube-operator")]))
            .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(ca_cert.not_valid_after_utc)
            .add_extension(x509.SubjectAlternativeName(serving_names(hosts, service)), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_key_usage(cert_sign=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    files = {"cafile": d / CA_CERT, "certfile": d / "tls.crt", "keyfile": d / "tls.key"}
    files["cafile"].write_bytes(ca.cert_pem)
    files["certfile"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    files["keyfile"].write_bytes(_pem_key(key))
    files["keyfile"].chmod(0o600)
    return ServingTLS(ca_pem=ca.cert_pem, **{k: str(v) for k, v in files.items()})


def ca_from_dir(cert_dir: str) -> CA:
    """The CA kept in cert_dir (local runs), made on first use."""
    d = Path(cert_dir)
    d.mkdir(parents=True, exist_ok=True)
    cert, key = d / CA_CERT, d / CA_KEY
    if cert.exists() and key.exists():
        return CA(cert.read_bytes(), key.read_bytes())
    ca = new_ca()
    key.touch(mode=0o600)
    key.write_bytes(ca.key_pem)
    cert.write_bytes(ca.cert_pem)
    return ca


async def ca_from_secret(kube: Kube, secret: str) -> CA:
    """The CA kept in Secret `namespace/name`, made on first use. The chart creates the Secret empty
    and grants get/patch on it alone; without a chart, the Secret is created (if RBAC allows)."""
    ns, name = secret.split("/", 1)
    path = ns_path(ns, "secrets", name)
    for _ in range(5):
        existing = await kube.get(path)
        data = (existing or {}).get("data") or {}
        if data.get(CA_CERT) and data.get(CA_KEY):
            return CA(base64.b64decode(data[CA_CERT]), base64.b64decode(data[CA_KEY]))
        if data.get(CA_CERT) or data.get(CA_KEY):
            raise RuntimeError(f"the CA Secret {secret} holds only one of {CA_CERT} and {CA_KEY}; "
                               "delete both keys to have a new CA made (running runner pods then fail)")
        ca = new_ca()
        encoded = {CA_CERT: base64.b64encode(ca.cert_pem).decode(), CA_KEY: base64.b64encode(ca.key_pem).decode()}
        try:
            if existing is None:
                body = {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                        "metadata": {"name": name, "namespace": ns}, "data": encoded}
                if await kube.create(ns_path(ns, "secrets"), body) is not None:
                    return ca
            else:  # there, but empty (the chart made it): fill it in, unless someone else just did
                await kube.merge_patch(path, {"metadata": {"resourceVersion": existing["metadata"]["resourceVersion"]},
                                              "data": encoded})
                return ca
        except ApiError as e:
            if e.status == 403:
                raise RuntimeError(f"the operator may not read or fill the CA Secret {secret} ({e}); the chart "
                                   "creates it and grants get/patch on it: was it deleted, or is rbac.create off?"
                                   ) from e
            if e.status != 409:
                raise
    raise RuntimeError(f"could not read or create the CA Secret {secret}")
