"""Key-signed DSSE envelopes in a Sigstore bundle (v0.3 JSON), the container of the OpenSSF
Model Signing format's key-based signatures (sigstore/model-transparency, PyPI model-signing,
`_signing/sign_ec_key.py`): what `mergepipe sign` and `mergepipe provenance --key` write, and the
only place that signs or checks a signature. Made with the `cryptography` package (the
`sign` extra); nothing here reads a model.

    bundle = {"mediaType": "application/vnd.dev.sigstore.bundle.v0.3+json",
              "verificationMaterial": {"publicKey": {"hint": FINGERPRINT}, "tlogEntries": []},
              "dsseEnvelope": {"payload": base64(STATEMENT), "payloadType": "application/vnd.in-toto+json",
                               "signatures": [{"sig": base64(DER ECDSA over PAE(STATEMENT)), "keyid": ""}]}}
    PAE(p) = b"DSSEv1 28 application/vnd.in-toto+json " + str(len(p)) + b" " + p

ECDSA on P-256 with SHA-256, P-384 with SHA-384 or P-521 with SHA-512: the keys model-signing's
key verifier accepts. FINGERPRINT, the signer as reported, is the hex sha256 of the public
key's PEM SubjectPublicKeyInfo, as model-signing computes the hint.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from mergepipe.errors import ConfigError, IntegrityError
from mergepipe.util.fs import canonical_json, read_json_object_text

BUNDLE_MEDIA_TYPE = "application/vnd.dev.sigstore.bundle.v0.3+json"
PAYLOAD_TYPE = "application/vnd.in-toto+json"
STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
CURVES = ("secp256r1", "secp384r1", "secp521r1")
NEW_KEY = ("openssl ecparam -name prime256v1 -genkey -noout -out key.pem && "
           "openssl ec -in key.pem -pubout -out key.pub.pem")


def _crypto():
    try:
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
    except ImportError:
        raise ConfigError("signing needs the cryptography package: pip install 'mergepipe[sign]'") from None
    return hashes, serialization, ec


def _hash_for(curve) -> object:
    hashes, _, _ = _crypto()
    return {256: hashes.SHA256, 384: hashes.SHA384, 521: hashes.SHA512}[curve.key_size]()


def _check_curve(key, path: Path) -> None:
    _, _, ec = _crypto()
    if not isinstance(key, ec.EllipticCurvePrivateKey | ec.EllipticCurvePublicKey):
        raise ConfigError(f"{path}: a {type(key).__name__.lstrip('_')}; the model-signing key format takes "
                          f"ECDSA keys on P-256, P-384 or P-521 only (make one: {NEW_KEY})")
    if key.curve.name not in CURVES:
        raise ConfigError(f"{path}: an EC key on {key.curve.name}; the model-signing key format takes "
                          "P-256, P-384 or P-521 only")


def load_private_key(path: Path, *, password_env: str | None = None):
    """The EC private key in PEM file `path`; its password, if encrypted, from the environment
    variable `password_env` (never from the command line).

    Raises:
        ConfigError: unreadable, not a PEM private key, encrypted without a password, or not EC.
    """
    _, serialization, _ = _crypto()
    password = None
    if password_env is not None:
        if password_env not in os.environ:
            raise ConfigError(f"--password-env {password_env}: no such environment variable")
        password = os.environ[password_env].encode()
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the private key: {e.strerror}") from None
    try:
        key = serialization.load_pem_private_key(data, password)
    except TypeError:  # encrypted and no password, or a password for a key that has none
        need = ("is encrypted: give its password's environment variable with --password-env"
                if password is None else "is not encrypted: drop --password-env")
        raise ConfigError(f"{path}: the private key {need}") from None
    except ValueError as e:
        raise ConfigError(f"{path}: not a PEM private key, or a wrong password ({e})") from None
    _check_curve(key, path)
    return key


def load_public_key(path: Path):
    """The EC public key in PEM file `path` (SubjectPublicKeyInfo).

    Raises:
        ConfigError: unreadable, not a PEM public key, or not EC.
    """
    _, serialization, _ = _crypto()
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the public key: {e.strerror}") from None
    try:
        key = serialization.load_pem_public_key(data)
    except ValueError:
        raise ConfigError(f"{path}: not a PEM public key (a private key? give the public half: "
                          f"openssl ec -in KEY.pem -pubout -out KEY.pub.pem)") from None
    _check_curve(key, path)
    return key


def fingerprint(public_key) -> str:
    """hex sha256 of the key's PEM SubjectPublicKeyInfo: the bundle's publicKey.hint."""
    _, serialization, _ = _crypto()
    pem = public_key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(pem).hexdigest()


def pae(payload: bytes) -> bytes:
    """DSSE v1's pre-authentication encoding of an in-toto payload: what is signed."""
    return b"DSSEv1 %d %s %d " % (len(PAYLOAD_TYPE), PAYLOAD_TYPE.encode(), len(payload)) + payload


def sign_statement(statement: dict, private_key) -> bytes:
    """The bundle (JSON bytes) of `statement` signed with `private_key`."""
    _, _, ec = _crypto()
    payload = canonical_json(statement)
    sig = private_key.sign(pae(payload), ec.ECDSA(_hash_for(private_key.curve)))
    bundle = {
        "mediaType": BUNDLE_MEDIA_TYPE,
        "verificationMaterial": {"publicKey": {"hint": fingerprint(private_key.public_key())},
                                 "tlogEntries": []},
        "dsseEnvelope": {"payload": base64.b64encode(payload).decode(), "payloadType": PAYLOAD_TYPE,
                         "signatures": [{"sig": base64.b64encode(sig).decode(), "keyid": ""}]},
    }
    return canonical_json(bundle, indent=2)


@dataclass(frozen=True, slots=True)
class Opened:
    """A bundle whose signature verified: its statement, and who signed it."""

    statement: dict
    signer: str  # fingerprint
    key_path: Path


def read_bundle(path: Path) -> dict:
    """The bundle JSON at `path`, its shape checked (no signature verified).

    Raises:
        IntegrityError: missing, unreadable, not JSON, or not a key-signed DSSE bundle.
    """
    try:
        bundle = json.loads(read_json_object_text(path))
    except FileNotFoundError:
        raise IntegrityError(f"{path}: no signature there (sign with `mergepipe sign OUT --key KEY.pem`)") \
            from None
    except OSError as e:
        raise IntegrityError(f"{path}: cannot read the signature: {e.strerror}") from None
    except (ValueError, RecursionError):
        raise IntegrityError(f"{path}: not a signature bundle (not a JSON object)") from None
    if bundle.get("mediaType") != BUNDLE_MEDIA_TYPE:
        raise IntegrityError(f"{path}: mediaType {str(bundle.get('mediaType'))[:80]!r} is not "
                             f"{BUNDLE_MEDIA_TYPE} (only key-signed model-signing bundles are checked)")
    env = bundle.get("dsseEnvelope")
    sigs = env.get("signatures") if isinstance(env, dict) else None
    if not isinstance(sigs, list) or len(sigs) != 1 or not isinstance(sigs[0], dict) \
            or not isinstance(sigs[0].get("sig"), str) or not isinstance(env.get("payload"), str):
        raise IntegrityError(f"{path}: dsseEnvelope must hold a payload and exactly one signature")
    if env.get("payloadType") != PAYLOAD_TYPE:
        raise IntegrityError(f"{path}: payloadType {str(env.get('payloadType'))[:80]!r} is not "
                             f"{PAYLOAD_TYPE}")
    return bundle


def signer_hint(bundle: dict) -> str | None:
    vm = bundle.get("verificationMaterial")
    pk = vm.get("publicKey") if isinstance(vm, dict) else None
    hint = pk.get("hint") if isinstance(pk, dict) else None
    return hint if isinstance(hint, str) and hint else None


def open_bundle(path: Path, trusted: list[Path]) -> Opened:
    """The statement of the bundle at `path`, if signed by one of the `trusted` public keys.

    Raises:
        IntegrityError: not a bundle, signed by none of the keys, or its payload not an in-toto Statement v1.
        ConfigError: a trusted key file is unusable.
    """
    _, _, ec = _crypto()
    from cryptography.exceptions import InvalidSignature
    keys = [(p, load_public_key(p)) for p in trusted]
    bundle = read_bundle(path)
    hint = signer_hint(bundle)
    candidates = [(p, k) for p, k in keys if hint is None or fingerprint(k) == hint]
    if not candidates:
        ours = ", ".join(f"{p} sha256:{fingerprint(k)[:16]}" for p, k in keys)
        raise IntegrityError(f"{path}: signed by key sha256:{hint}, which is none of the trusted keys "
                             f"({ours})")
    env = bundle["dsseEnvelope"]
    try:
        payload = base64.b64decode(env["payload"], validate=True)
        sig = base64.b64decode(env["signatures"][0]["sig"], validate=True)
    except (binascii.Error, ValueError):
        raise IntegrityError(f"{path}: payload or signature is not base64") from None
    for key_path, key in candidates:
        try:
            key.verify(sig, pae(payload), ec.ECDSA(_hash_for(key.curve)))
        except InvalidSignature:
            continue
        return Opened(_statement(payload, path), fingerprint(key), key_path)
    names = ", ".join(str(p) for p, _ in candidates)
    raise IntegrityError(f"{path}: the signature does not verify with {names} (the statement was altered "
                         "after signing, or another key signed it)")


def _statement(payload: bytes, path: Path) -> dict:
    try:
        statement = json.loads(payload)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise IntegrityError(f"{path}: the signed payload is not JSON") from None
    if not isinstance(statement, dict) or statement.get("_type") != STATEMENT_TYPE:
        raise IntegrityError(f"{path}: the signed payload is not an in-toto Statement v1")
    return statement
