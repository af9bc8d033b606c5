"""C2PA signing: the operator's certificate and key, or a per-install local chain made on first use.

A C2PA manifest is only as trustworthy as its signer. An operator brings a certificate from a CA that
validators trust (settings `c2pa_cert`, `c2pa_key`, passphrase from the environment only). Without one the
app makes its own chain once under `cache_dir/c2pa`: a root CA and an end-entity ES256 (P-256) certificate
with the key usages C2PA asks for (digitalSignature, extended key usage emailProtection). Every manifest it
signs validates cryptographically, but validators report `signingCredential.untrusted` because no trust
list holds this root: that is the honest state of a self-made chain, documented in docs/sharing.md.
"""

from __future__ import annotations

import datetime
import io
import os
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from neuron_app.errors import GenerationFailed, SettingsError

#: The subject of the local chain's certificates; `verify` names it as a local, untrusted signer.
LOCAL_ORGANIZATION = "neuron-app local signer (untrusted by default)"
LOCAL_VALID_DAYS = 3650
CHAIN_FILE, KEY_FILE = "chain.pem", "key.pem"
SOURCE = "http://cv.iptc.org/newscodes/digitalsourcetype/trainedAlgorithmicMedia"
#: Signed once at start on a blank image: a chain or key the library refuses stops the start.
SELF_TEST_MANIFEST = {
    "claim_generator_info": [{"name": "neuron-app"}],
    "assertions": [
        {"label": "c2pa.actions", "data": {"actions": [{"action": "c2pa.created", "digitalSourceType": SOURCE}]}}
    ],
}


@dataclass(frozen=True)
class SigningKey:
    """PEM certificate chain (signer first), unencrypted PEM key (in memory only), and the C2PA algorithm."""

    chain_pem: bytes
    key_pem: bytes
    alg: str  # es256 | es384 | es512 | ps256 | ed25519
    origin: str  # "operator" | "local"
    subject: str  # the signing certificate's subject, for info and logs (never the key)


def _name(common_name: str) -> Any:
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, LOCAL_ORGANIZATION),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def _make_local_chain() -> tuple[bytes, bytes]:
    """A root CA and an end-entity certificate it issued, both P-256: (chain PEM, end-entity key PEM)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID

    now = datetime.datetime.now(datetime.UTC)
    start, end = now - datetime.timedelta(days=1), now + datetime.timedelta(days=LOCAL_VALID_DAYS)
    no = dict.fromkeys(
        ("content_commitment", "key_encipherment", "data_encipherment", "key_agreement", "encipher_only"), False
    ) | {"decipher_only": False}
    root_key, leaf_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    root = (
        x509.CertificateBuilder()
        .subject_name(_name("neuron-app local root CA"))
        .issuer_name(_name("neuron-app local root CA"))
        .public_key(root_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=False, key_cert_sign=True, crl_sign=True, **no), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(root_key.public_key()), critical=False)
        .sign(root_key, hashes.SHA256())
    )
    leaf = (
        x509.CertificateBuilder()
        .subject_name(_name("neuron-app image signer"))
        .issuer_name(root.subject)
        .public_key(leaf_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=False, crl_sign=False, **no), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.EMAIL_PROTECTION]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(leaf_key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(root_key.public_key()), critical=False)
        .sign(root_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    chain = leaf.public_bytes(pem) + root.public_bytes(pem)
    key = leaf_key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    return chain, key


def _write_private(path: Path, data: bytes) -> None:
    """Atomically, readable by this user only (the key)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def local_chain(folder: Path) -> tuple[bytes, bytes]:
    """The per-install chain under `folder`, made on first use (one process wins the race, the rest read it)."""
    from filelock import FileLock

    folder.mkdir(parents=True, exist_ok=True)
    chain_path, key_path = folder / CHAIN_FILE, folder / KEY_FILE
    with FileLock(str(folder / ".lock")):
        if not (chain_path.is_file() and key_path.is_file()):
            chain, key = _make_local_chain()
            _write_private(key_path, key)
            _write_private(chain_path, chain)
    return chain_path.read_bytes(), key_path.read_bytes()


def _algorithm(key: Any) -> str:
    from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa

    if isinstance(key, ec.EllipticCurvePrivateKey):
        by_curve = {"secp256r1": "es256", "secp384r1": "es384", "secp521r1": "es512"}
        if key.curve.name in by_curve:
            return by_curve[key.curve.name]
    if isinstance(key, ed25519.Ed25519PrivateKey):
        return "ed25519"
    if isinstance(key, rsa.RSAPrivateKey):
        return "ps256"
    raise SettingsError(f"c2pa_key: a {type(key).__name__} cannot sign C2PA (use EC P-256/P-384, Ed25519 or RSA)")


def signing_key(cert: Path | None, key: Path | None, passphrase: str | None, cache_dir: Path) -> SigningKey:
    """The operator's key when configured (checked now: a bad file stops the start), else the local chain."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    if cert is None or key is None:
        chain_pem, key_pem = local_chain(cache_dir / "c2pa")
        origin = "local"
    else:
        chain_pem, key_pem, origin = cert.read_bytes(), key.read_bytes(), "operator"
    try:
        certs = x509.load_pem_x509_certificates(chain_pem)
        private = serialization.load_pem_private_key(key_pem, password=passphrase.encode() if passphrase else None)
    except (ValueError, TypeError) as exc:
        # The message names the files, never their contents.
        raise SettingsError(f"c2pa_cert/c2pa_key ({cert}, {key}) cannot be read as PEM: {exc}") from None
    if certs[0].public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    ) != private.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo):
        raise SettingsError(f"c2pa_key ({key}) is not the key of the first certificate in c2pa_cert ({cert})")
    plain = private.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return SigningKey(chain_pem, plain, _algorithm(private), origin, certs[0].subject.rfc4514_string())


class ManifestSigner:
    """Signs PNG bytes with a C2PA manifest; one c2pa Context (no thumbnail: it doubled a PNG's size)."""

    def __init__(self, key: SigningKey) -> None:
        import c2pa

        self.key = key
        self._c2pa = c2pa
        self._context = c2pa.Context.from_dict({"builder": {"thumbnail": {"enabled": False}}})
        self._lock = threading.Lock()
        try:  # a chain the library refuses stops the start, not the first request
            self.sign(_blank_png(), SELF_TEST_MANIFEST)
        except GenerationFailed as exc:
            raise SettingsError(str(exc)) from None

    def sign(self, png: bytes, manifest: dict[str, Any], mime: str = "image/png") -> bytes:
        """`png` (or a JPEG, a WebP: `mime`) with the manifest embedded; the manifest's hash binds these exact bytes."""
        c2pa = self._c2pa
        info = c2pa.C2paSignerInfo(self.key.alg, self.key.chain_pem, self.key.key_pem, None)
        out = io.BytesIO()
        try:
            with self._lock, c2pa.Signer.from_info(info) as signer, c2pa.Builder(manifest, self._context) as builder:
                builder.sign(signer, mime, io.BytesIO(png), out)
        except c2pa.C2paError as exc:
            raise GenerationFailed(f"C2PA signing failed with the {self.key.origin} certificate: {exc}") from None
        return out.getvalue()


def _blank_png() -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buffer, format="PNG")
    return buffer.getvalue()
