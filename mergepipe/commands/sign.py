"""`mergepipe sign` and the signature check of `verify`/`audit --public-key`: an output folder
signed in the OpenSSF Model Signing format (v1.0 predicate, `files` serialization, sha256),
key-based, so model-signing's own verifier accepts it (`scripts/model_signing_crosscheck.py`).

The signed statement (inside the DSSE bundle of commands/dsse.py):

    {"_type": "https://in-toto.io/Statement/v1",
     "subject": [{"name": FOLDER NAME, "digest": {"sha256": sha256(digest 1 || ... || digest n)}}],
     "predicateType": "https://model_signing/signature/v1.0",
     "predicate": {"serialization": {"method": "files", "hash_type": "sha256", "allow_symlinks": false,
                                     "ignore_paths": ["model.sig"]},
                   "resources": [{"name": FILE, "algorithm": "sha256", "digest": HEX}, ...]}}   sorted by name

Resources are every file of the folder, manifest.json included, all but the signature itself:
a manifest forged in mergepipe's format (every hash recomputed) no longer matches. A folder is
signed only when it verifies against its manifest and holds nothing the manifest does not
record; a check fails on any file added, missing or changed, naming it.
"""
from __future__ import annotations

import hashlib
import stat
from dataclasses import dataclass
from pathlib import Path

from mergepipe.commands import dsse
from mergepipe.errors import ConfigError, IntegrityError, OutputError
from mergepipe.output.manifest import MANIFEST, SIGNATURE, verify_outputs
from mergepipe.util.fs import atomic_write_bytes

PREDICATE_TYPE = "https://model_signing/signature/v1.0"
SERIALIZATION = {"method": "files", "hash_type": "sha256", "allow_symlinks": False,
                 "ignore_paths": [SIGNATURE]}


def sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def folder_files(out_dir: Path) -> list[str]:
    """Every file under `out_dir` (relative POSIX paths, sorted) but its top-level signature.

    Raises:
        IntegrityError: a symbolic link or a special file (the format signs regular files only).
    """
    names = []
    for path in sorted(out_dir.rglob("*")):
        rel = path.relative_to(out_dir).as_posix()
        mode = path.lstat().st_mode
        if stat.S_ISLNK(mode) or not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            raise IntegrityError(f"{path}: a symbolic link or special file; a signature covers regular "
                                 "files only")
        if stat.S_ISREG(mode) and rel != SIGNATURE:
            names.append(rel)
    return names


def model_statement(name: str, digests: dict[str, str]) -> dict:
    """The model-signing v1.0 statement of a folder named `name` whose files have `digests` (sha256 hex)."""
    resources = [{"name": n, "algorithm": "sha256", "digest": digests[n]} for n in sorted(digests)]
    root = hashlib.sha256(b"".join(bytes.fromhex(r["digest"]) for r in resources)).hexdigest()
    return {"_type": dsse.STATEMENT_TYPE, "subject": [{"name": name, "digest": {"sha256": root}}],
            "predicateType": PREDICATE_TYPE,
            "predicate": {"serialization": dict(SERIALIZATION), "resources": resources}}


def checked_output(out_dir: Path, *, deep: bool = False) -> dict:
    """The manifest of `out_dir`, which verifies against it (`verify_outputs`) and holds no file,
    in any subfolder, that the manifest does not record: what a signature or provenance may vouch for.

    Raises:
        IntegrityError: the folder does not verify, or holds a file its manifest does not record.
    """
    man = verify_outputs(out_dir, deep=deep)
    recorded = set(man["outputs"]["files"]) | {MANIFEST}
    foreign = [n for n in folder_files(out_dir) if n not in recorded]
    if foreign:
        raise IntegrityError(f"{out_dir / foreign[0]}: not recorded in the manifest; a signature covers "
                             "every file of the folder: move it out first")
    return man


def file_digests(out_dir: Path) -> dict[str, str]:
    """sha256 hex of every file `folder_files` lists, by name (every byte read)."""
    return {n: sha256_file(out_dir / n) for n in folder_files(out_dir)}


def signature_path(out_dir: Path, signature: Path | None) -> Path:
    """Where the signature is: OUT/model.sig, or a path outside the folder (a file inside it
    other than model.sig would be a file the manifest does not record)."""
    if signature is None:
        return out_dir / SIGNATURE
    from mergepipe.output.safety import inside_output
    if inside_output(signature, out_dir) and signature.resolve() != (out_dir / SIGNATURE).resolve():
        raise ConfigError(f"--signature {signature}: inside {out_dir}; there it must be {SIGNATURE} "
                          "(any other file there is one its manifest does not record)")
    return signature


def sign_output(out_dir: Path, key_path: Path, *, signature: Path | None = None,
                password_env: str | None = None, force: bool = False, deep: bool = False) -> str:
    """Sign `out_dir` (checked against its manifest first) with the private key at `key_path`;
    write the bundle to `signature` (default OUT/model.sig). Returns the one-line report.

    An existing signature is replaced when the same key made it, else only with `force` (it
    may be another publisher's); a file there that is not a signature bundle is never replaced.

    Raises:
        IntegrityError: the folder does not verify, or holds a file its manifest does not record.
        ConfigError: the key is unusable. OutputError: an existing signature is in the way.
    """
    key = dsse.load_private_key(key_path, password_env=password_env)
    dest = signature_path(out_dir, signature)
    man = checked_output(out_dir, deep=deep)
    _check_replaceable(dest, dsse.fingerprint(key.public_key()), force=force)
    digests = file_digests(out_dir)
    bundle = dsse.sign_statement(model_statement(out_dir.resolve().name, digests), key)
    try:
        atomic_write_bytes(dest, bundle)
    except OSError as e:
        raise OutputError(f"{dest}: cannot write the signature: {e.strerror}") from None
    return (f"{dest}: signed {len(digests)} files of {out_dir} (manifest {man['manifest_hash'][:16]}) "
            f"with key sha256:{dsse.fingerprint(key.public_key())}")


def _check_replaceable(dest: Path, ours: str, *, force: bool) -> None:
    if not dest.exists() and not dest.is_symlink():
        return
    try:
        hint = dsse.signer_hint(dsse.read_bundle(dest))
    except IntegrityError:
        raise OutputError(f"{dest}: exists and is not a signature bundle; refusing to replace it") from None
    if hint != ours and not force:
        raise OutputError(f"{dest}: already signed by key sha256:{hint}, not this one; pass --force to "
                          "replace that signature")


@dataclass(frozen=True, slots=True)
class Signed:
    """A folder's files as a verified signature lists them, and who signed."""

    signer: str
    key_path: Path
    digests: dict[str, str]  # file -> sha256 hex


def read_model_signature(path: Path, trusted: list[Path]) -> Signed:
    """The file digests a model-signing v1.0 signature at `path` lists, if one of the `trusted`
    keys signed it.

    Raises:
        IntegrityError: not signed by a trusted key, or not a consistent v1.0 files/sha256 statement.
    """
    opened = dsse.open_bundle(path, trusted)
    st = opened.statement
    if st.get("predicateType") != PREDICATE_TYPE:
        raise IntegrityError(f"{path}: predicateType {str(st.get('predicateType'))[:80]!r} is not "
                             f"{PREDICATE_TYPE}")
    pred = st.get("predicate") if isinstance(st.get("predicate"), dict) else {}
    ser = pred.get("serialization") if isinstance(pred.get("serialization"), dict) else {}
    if ser.get("method") != "files" or ser.get("hash_type") != "sha256":
        raise IntegrityError(f"{path}: serialization {ser.get('method')!r}/{ser.get('hash_type')!r}; "
                             "mergepipe checks the files/sha256 serialization only")
    resources = pred.get("resources")
    if not isinstance(resources, list) or not all(
            isinstance(r, dict) and isinstance(r.get("name"), str) and r.get("algorithm") == "sha256"
            and isinstance(r.get("digest"), str) and len(r["digest"]) == 64 for r in resources):
        raise IntegrityError(f"{path}: predicate.resources is not a list of sha256 file digests")
    digests = {r["name"]: r["digest"].lower() for r in resources}
    if len(digests) != len(resources):
        raise IntegrityError(f"{path}: predicate.resources names a file twice")
    subject = st.get("subject")
    try:
        root = hashlib.sha256(b"".join(bytes.fromhex(r["digest"]) for r in resources)).hexdigest()
        want = subject[0]["digest"]["sha256"] if len(subject) == 1 else None
    except (ValueError, TypeError, KeyError, IndexError):
        raise IntegrityError(f"{path}: subject or resource digests malformed") from None
    if want != root:
        raise IntegrityError(f"{path}: the subject digest is not that of the listed resources")
    return Signed(opened.signer, opened.key_path, digests)


def check_signature(out_dir: Path, trusted: list[Path], *, signature: Path | None = None) -> str:
    """Check that one of the `trusted` public keys signed exactly the files of `out_dir` as
    they are: every file is listed, every listed file is there with the signed sha256
    (every byte reread). Returns what to report: who signed, how many files.

    Raises:
        IntegrityError: no signature, another signer, or a file added, missing or changed (named).
    """
    path = signature_path(out_dir, signature)
    signed = read_model_signature(path, trusted)
    names = folder_files(out_dir)
    extra = [n for n in names if n not in signed.digests]
    if extra:
        raise IntegrityError(f"{out_dir / extra[0]}: not covered by the signature {path} (added after "
                             "signing)")
    missing = sorted(set(signed.digests) - set(names))
    if missing:
        raise IntegrityError(f"{out_dir / missing[0]}: signed by {path} but missing")
    for name in names:
        if sha256_file(out_dir / name) != signed.digests[name]:
            what = "not the manifest that was signed (forged or rebuilt since?)" if name == MANIFEST \
                else "not the bytes that were signed (edited since?)"
            raise IntegrityError(f"{out_dir / name}: {what}")
    return (f"signed by key sha256:{signed.signer} ({signed.key_path}): {len(names)} files, "
            f"{MANIFEST} included")


def trusted_keys(paths: list[str], *, signature: str | None = None) -> list[Path]:
    """The public key files given, each loaded once as a check, so a bad one (or a `--signature`
    given without a key) fails before any rehash.

    Raises:
        ConfigError: a key file is unreadable, not a PEM public key, or not EC; no key for `signature`.
    """
    if signature is not None and not paths:
        raise ConfigError(f"--signature {signature}: give the signer's public key with --public-key PUB.pem")
    keys = [Path(p) for p in paths]
    for key in keys:
        dsse.load_public_key(key)
    return keys


def signature_report(out_dir: Path, trusted: list[Path], *, signature: Path | None = None) -> str | None:
    """What `verify`/`audit` add about the signature: who signed (checked with `trusted`), that
    one is there unchecked (no key given: never passed over in silence), or None (none there).

    Raises:
        IntegrityError: as check_signature.
    """
    if trusted:
        return check_signature(out_dir, trusted, signature=signature)
    if (out_dir / SIGNATURE).exists():
        return f"{SIGNATURE} not checked (give the signer's public key with --public-key PUB.pem)"
    return None
