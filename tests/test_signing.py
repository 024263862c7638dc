"""`mergepipe sign`, `verify/audit --public-key` and `mergepipe provenance` (issue 27): an output
signed in the OpenSSF model-signing format (key-based), who signed it, and every forgery that
plain `verify` cannot see: a manifest rewritten with its hashes recomputed, a re-signature by
another key, an altered statement, a file added where the manifest check does not look."""
from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519

from mergepipe.cli import main
from mergepipe.commands import dsse
from mergepipe.commands.provenance import CONTENT_HASH, SLSA_PROVENANCE, read_provenance
from mergepipe.commands.sign import check_signature
from mergepipe.errors import IntegrityError
from mergepipe.output.manifest import MANIFEST, SIGNATURE, dumps, load_manifest, manifest_hash
from tests.helpers import write_config

ROOT = Path(__file__).resolve().parent.parent


def write_key(folder: Path, name: str, *, curve=ec.SECP256R1(),
              password: bytes | None = None) -> tuple[Path, Path]:
    """(private PEM, public PEM) of a new EC key."""
    key = ec.generate_private_key(curve)
    enc = serialization.BestAvailableEncryption(password) if password else serialization.NoEncryption()
    priv, pub = folder / f"{name}.pem", folder / f"{name}.pub.pem"
    priv.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, enc))
    pub.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                  serialization.PublicFormat.SubjectPublicKeyInfo))
    return priv, pub


def fingerprint(pub: Path) -> str:
    return hashlib.sha256(pub.read_bytes()).hexdigest()  # the PEM as written: what the hint hashes


def cli(capsys, *args) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main([*map(str, args)])
    got = capsys.readouterr()
    return rc, got.out, got.err


@pytest.fixture(scope="module")
def merged(tiny_family, tmp_path_factory) -> Path:
    """A finished merge of the tiny family (copied per test: tests edit it)."""
    site = tmp_path_factory.mktemp("signed-site")
    cfg = write_config(site, tiny_family)
    assert main(["run", str(cfg), "-q"]) == 0
    return site / "out"


@pytest.fixture
def out(merged, tmp_path) -> Path:
    dst = tmp_path / "release"
    shutil.copytree(merged, dst)
    return dst


@pytest.fixture
def keys(tmp_path) -> dict[str, tuple[Path, Path]]:
    return {"publisher": write_key(tmp_path, "publisher"), "other": write_key(tmp_path, "other")}


def forge_manifest(out: Path, edit) -> None:
    """Rewrite manifest.json with `edit` applied and manifest_hash recomputed: valid in mergepipe's format."""
    man = load_manifest(out)
    edit(man)
    man["manifest_hash"] = manifest_hash(man)
    (out / MANIFEST).write_bytes(dumps(man))


def test_signed_output_verifies_and_names_the_signer_by_key_fingerprint(out, keys, capsys):
    priv, pub = keys["publisher"]
    rc, _, err = cli(capsys, "sign", out, "--key", priv)
    assert rc == 0, err
    assert (out / SIGNATURE).is_file() and fingerprint(pub) in err
    rc, stdout, err = cli(capsys, "verify", out, "--public-key", pub)
    assert rc == 0, err
    assert f"signed by key sha256:{fingerprint(pub)}" in stdout
    n_files = len([p for p in out.iterdir() if p.name != SIGNATURE])
    assert f"{n_files} files, {MANIFEST} included" in stdout


def test_signature_covers_every_file_and_the_manifest(out, keys):
    priv, pub = keys["publisher"]
    assert main(["sign", str(out), "--key", str(priv), "-q"]) == 0
    bundle = json.loads((out / SIGNATURE).read_text())
    statement = json.loads(base64.b64decode(bundle["dsseEnvelope"]["payload"]))
    assert statement["predicateType"] == "https://model_signing/signature/v1.0"
    resources = {r["name"]: r["digest"] for r in statement["predicate"]["resources"]}
    assert resources == {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
                         for p in out.iterdir() if p.name != SIGNATURE}
    assert statement["predicate"]["serialization"]["ignore_paths"] == [SIGNATURE]
    root = hashlib.sha256(b"".join(bytes.fromhex(resources[n]) for n in sorted(resources))).hexdigest()
    assert statement["subject"] == [{"name": out.name, "digest": {"sha256": root}}]


def test_forged_manifest_passes_plain_verify_but_not_the_signature(out, keys, capsys):
    priv, pub = keys["publisher"]
    assert main(["sign", str(out), "--key", str(priv), "-q"]) == 0
    forge_manifest(out, lambda man: man["plan"]["experts"][0].update(path="/hub/trusted-org/famous-model"))
    rc, stdout, _ = cli(capsys, "verify", out)
    assert rc == 0 and "model.sig not checked" in stdout  # the gap plain verify leaves, said aloud
    rc, _, err = cli(capsys, "verify", out, "--public-key", pub)
    assert rc == 6
    assert f"{out / MANIFEST}: not the manifest that was signed" in err


def test_manifest_re_signed_by_another_key_fails_naming_that_key(out, keys, capsys):
    priv, pub = keys["publisher"]
    other_priv, other_pub = keys["other"]
    assert main(["sign", str(out), "--key", str(priv), "-q"]) == 0
    forge_manifest(out, lambda man: man["budget"].update(spec="10%"))
    assert main(["sign", str(out), "--key", str(other_priv), "--force", "-q"]) == 0
    rc, _, err = cli(capsys, "verify", out, "--public-key", pub)
    assert rc == 6
    assert f"signed by key sha256:{fingerprint(other_pub)}, which is none of the trusted keys" in err
    rc, stdout, _ = cli(capsys, "verify", out, "--public-key", pub, "--public-key", other_pub)
    assert rc == 0 and fingerprint(other_pub) in stdout  # any one trusted key is enough


def test_statement_altered_after_signing_fails(out, keys, capsys):
    priv, pub = keys["publisher"]
    assert main(["sign", str(out), "--key", str(priv), "-q"]) == 0
    bundle = json.loads((out / SIGNATURE).read_text())
    statement = json.loads(base64.b64decode(bundle["dsseEnvelope"]["payload"]))
    statement["subject"][0]["name"] = "another-model"
    bundle["dsseEnvelope"]["payload"] = base64.b64encode(json.dumps(statement).encode()).decode()
    (out / SIGNATURE).write_text(json.dumps(bundle))
    rc, _, err = cli(capsys, "verify", out, "--public-key", pub)
    assert rc == 6 and "the signature does not verify with" in err


def test_a_file_edited_added_or_removed_after_signing_is_named(out, keys):
    priv, pub = keys["publisher"]
    assert main(["sign", str(out), "--key", str(priv), "-q"]) == 0
    weights = out / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="model.safetensors: not the bytes that were signed"):
        check_signature(out, [pub])
    weights.unlink()
    with pytest.raises(IntegrityError, match="model.safetensors: signed by .* but missing"):
        check_signature(out, [pub])


def test_a_file_in_a_subfolder_is_caught_though_the_manifest_check_skips_folders(out, keys, capsys):
    priv, pub = keys["publisher"]
    assert main(["sign", str(out), "--key", str(priv), "-q"]) == 0
    (out / "extra").mkdir()
    (out / "extra" / "payload.py").write_text("print('hi')\n")
    assert main(["verify", str(out), "-q"]) == 0
    rc, _, err = cli(capsys, "verify", out, "--public-key", pub)
    assert rc == 6 and "extra/payload.py: not covered by the signature" in err
    rc, _, err = cli(capsys, "sign", out, "--key", priv)
    assert rc == 6 and "extra/payload.py: not recorded in the manifest" in err


def test_sign_refuses_an_output_that_does_not_verify_and_writes_nothing(out, keys, capsys):
    (out / "config.json").write_text("{}")
    rc, _, err = cli(capsys, "sign", out, "--key", keys["publisher"][0])
    assert rc == 6 and "config.json: edited since it was published" in err
    assert not (out / SIGNATURE).exists()


def test_an_existing_signature_is_replaced_only_when_it_is_ours_or_forced(out, keys, capsys):
    priv, _ = keys["publisher"]
    other_priv, other_pub = keys["other"]
    assert main(["sign", str(out), "--key", str(priv), "-q"]) == 0
    assert main(["sign", str(out), "--key", str(priv), "-q"]) == 0  # re-signing with the same key
    rc, _, err = cli(capsys, "sign", out, "--key", other_priv)
    assert rc == 7 and "already signed by key sha256:" in err and "--force" in err
    (out / SIGNATURE).write_text("my notes\n")
    rc, _, err = cli(capsys, "sign", out, "--key", other_priv, "--force")
    assert rc == 7 and "is not a signature bundle; refusing to replace it" in err
    assert (out / SIGNATURE).read_text() == "my notes\n"


def test_keys_outside_the_model_signing_format_are_refused_in_one_line(out, tmp_path, capsys):
    key = ed25519.Ed25519PrivateKey.generate()
    path = tmp_path / "ed.pem"
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    rc, _, err = cli(capsys, "sign", out, "--key", path)
    assert rc == 2 and "ECDSA keys on P-256, P-384 or P-521 only" in err
    rc, _, err = cli(capsys, "verify", out, "--public-key", out / "config.json")
    assert rc == 2 and "not a PEM public key" in err
    rc, _, err = cli(capsys, "verify", out, "--signature", out / SIGNATURE)
    assert rc == 2 and "give the signer's public key with --public-key" in err


def test_an_encrypted_p384_key_signs_with_its_password_from_the_environment(out, tmp_path, capsys,
                                                                            monkeypatch):
    priv, pub = write_key(tmp_path, "vault", curve=ec.SECP384R1(), password=b"s3cret")
    rc, _, err = cli(capsys, "sign", out, "--key", priv)
    assert rc == 2 and "is encrypted" in err
    monkeypatch.setenv("KEYPASS", "s3cret")
    assert main(["sign", str(out), "--key", str(priv), "--password-env", "KEYPASS", "-q"]) == 0
    assert main(["verify", str(out), "--public-key", str(pub), "-q"]) == 0


def test_a_signed_output_stays_up_to_date_and_keeps_its_signature(tiny_family, tmp_path, keys, capsys):
    cfg = write_config(tmp_path, tiny_family)
    assert main(["run", str(cfg), "-q"]) == 0
    assert main(["sign", str(tmp_path / "out"), "--key", str(keys["publisher"][0]), "-q"]) == 0
    rc, _, err = cli(capsys, "run", cfg)
    assert rc == 0 and "up to date" in err
    assert main(["verify", str(tmp_path / "out"), "--public-key", str(keys["publisher"][1]), "-q"]) == 0


def test_audit_checks_the_signature_after_the_replay(out, keys, capsys):
    priv, pub = keys["publisher"]
    assert main(["sign", str(out), "--key", str(priv), "-q"]) == 0
    rc, stdout, err = cli(capsys, "audit", out, "--public-key", pub, "-q")
    assert rc == 0, err
    assert f"signature: signed by key sha256:{fingerprint(pub)}" in stdout
    rc, _, err = cli(capsys, "audit", out, "--public-key", keys["other"][1], "-q")
    assert rc == 6 and "none of the trusted keys" in err


def test_provenance_lists_the_files_the_inputs_and_the_plan(out, tmp_path, capsys):
    dest = tmp_path / "release.provenance.json"
    assert main(["provenance", str(out), "-o", str(dest), "-q"]) == 0
    statement = json.loads(dest.read_text())
    man = load_manifest(out)
    assert statement["predicateType"] == SLSA_PROVENANCE
    assert {s["name"]: s["digest"]["sha256"] for s in statement["subject"]} == {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in out.iterdir()}
    build = statement["predicate"]["buildDefinition"]
    assert build["externalParameters"]["plan_hash"] == man["plan_hash"]
    assert build["externalParameters"]["plan"]["method"] == man["plan"]["method"]
    deps = {d["name"]: d for d in build["resolvedDependencies"]}
    for record in [man["plan"]["base"], *man["plan"]["experts"]]:
        assert deps[record["name"]]["digest"] == {CONTENT_HASH: record["content_hash"]}
        assert deps[record["name"]]["annotations"]["path"] == record["path"]
    assert statement["predicate"]["runDetails"]["metadata"]["invocationId"] == man["manifest_hash"]
    again = tmp_path / "again.json"
    assert main(["provenance", str(out), "-o", str(again), "-q"]) == 0
    assert again.read_bytes() == dest.read_bytes()  # no timestamps: the same output, the same statement
    rc, _, err = cli(capsys, "provenance", out, "-o", dest)
    assert rc == 7 and "exists" in err
    rc, _, err = cli(capsys, "provenance", out, "-o", out / "provenance.json")
    assert rc == 7 and "inside" in err and not (out / "provenance.json").exists()


def test_signed_provenance_opens_only_with_the_signers_key(out, tmp_path, keys):
    priv, pub = keys["publisher"]
    dest = tmp_path / "provenance.sig.json"
    assert main(["provenance", str(out), "-o", str(dest), "--key", str(priv), "-q"]) == 0
    statement, signer = read_provenance(dest, [pub])
    assert signer == fingerprint(pub) and statement["predicateType"] == SLSA_PROVENANCE
    with pytest.raises(IntegrityError, match="none of the trusted keys"):
        read_provenance(dest, [keys["other"][1]])
    assert main(["sign", str(out), "--key", str(priv), "-q"]) == 0
    with pytest.raises(IntegrityError, match="predicateType is not https://slsa.dev/provenance/v1"):
        read_provenance(out / SIGNATURE, [pub])  # a model signature is no provenance, though one key made both


def test_bundle_signature_is_ecdsa_over_the_dsse_pae(out, keys):
    """The envelope, checked with cryptography alone, as any DSSE verifier would."""
    priv, pub = keys["publisher"]
    assert main(["sign", str(out), "--key", str(priv), "-q"]) == 0
    bundle = json.loads((out / SIGNATURE).read_text())
    env = bundle["dsseEnvelope"]
    payload = base64.b64decode(env["payload"])
    kind = env["payloadType"].encode()
    pae = b"DSSEv1 %d %s %d %s" % (len(kind), kind, len(payload), payload)
    key = serialization.load_pem_public_key(pub.read_bytes())
    key.verify(base64.b64decode(env["signatures"][0]["sig"]), pae, ec.ECDSA(dsse._hash_for(key.curve)))
    assert bundle["mediaType"] == dsse.BUNDLE_MEDIA_TYPE
    assert bundle["verificationMaterial"]["publicKey"]["hint"] == fingerprint(pub)


MODEL_SIGNING_PYTHON = os.environ.get("MODEL_SIGNING_PYTHON")  # an interpreter with model-signing installed


@pytest.mark.skipif(not MODEL_SIGNING_PYTHON, reason="set MODEL_SIGNING_PYTHON to an interpreter with "
                    "model-signing (scripts/model_signing_crosscheck.py)")
def test_model_signing_accepts_our_signatures_and_we_accept_its(merged, out, keys, tmp_path):
    priv, pub = keys["publisher"]
    script = [MODEL_SIGNING_PYTHON, str(ROOT / "scripts" / "model_signing_crosscheck.py")]
    assert main(["sign", str(out), "--key", str(priv), "-q"]) == 0
    ok = subprocess.run([*script, "verify", str(out), str(pub)], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    forge_manifest(out, lambda man: man["budget"].update(spec="10%"))
    bad = subprocess.run([*script, "verify", str(out), str(pub)], capture_output=True, text=True)
    assert bad.returncode == 1 and MANIFEST in bad.stderr  # its verifier sees the forgery too
    theirs = tmp_path / "theirs"
    shutil.copytree(merged, theirs)
    made = subprocess.run([*script, "sign", str(theirs), str(priv)], capture_output=True, text=True)
    assert made.returncode == 0, made.stderr
    assert check_signature(theirs, [pub]).startswith(f"signed by key sha256:{fingerprint(pub)}")


def test_provenance_never_writes_into_an_input_even_with_force(out, capsys):
    man = load_manifest(out)
    base = Path(man["plan"]["base"]["path"])
    if not base.is_absolute():
        base = out.parent / base
    target = base / "config.json"
    before = target.read_bytes()
    rc, _, err = cli(capsys, "provenance", out, "-o", target, "--force")
    assert rc == 7 and "an input of this command" in err and "even with --force" in err
    assert target.read_bytes() == before
