#!/usr/bin/env python3
"""Check mergepipe's signatures with the OpenSSF model-signing library itself, and make one with it
for mergepipe to check (tests/test_signing.py runs this when MODEL_SIGNING_PYTHON names an
interpreter that has it; mergepipe does not depend on it: it pulls in sigstore and ~30 packages).

Usage (an interpreter with `pip install model-signing==1.1.1`; 1.1.1 also needs pyOpenSSL):
  python scripts/model_signing_crosscheck.py verify OUT PUB.pem [--signature SIG]
      model-signing's verifier checks OUT against its signature
  python scripts/model_signing_crosscheck.py sign OUT KEY.pem
      model-signing signs OUT into OUT/model.sig
Exit 0 when model-signing accepts (or signed), 1 with its error on stderr.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import model_signing

SIGNATURE = "model.sig"  # mergepipe's name for it, inside the folder


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("action", choices=["verify", "sign"])
    p.add_argument("folder", type=Path)
    p.add_argument("key", type=Path, help="public key (verify) or private key (sign), PEM")
    p.add_argument("--signature", type=Path)
    args = p.parse_args(argv)
    sig = args.signature or args.folder / SIGNATURE
    try:
        if args.action == "verify":
            verifier = model_signing.verifying.Config().use_elliptic_key_verifier(public_key=args.key)
            verifier.verify(args.folder, sig)
        else:
            hashing = model_signing.hashing.Config().set_ignored_paths(paths=[SIGNATURE])
            model_signing.signing.Config().use_elliptic_key_signer(private_key=args.key) \
                .set_hashing_config(hashing).sign(args.folder, sig)
    except Exception as e:  # noqa: BLE001 -- whatever model-signing raises is its answer: report it
        print(f"model-signing: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(f"model-signing {model_signing.__version__}: {args.action} {args.folder}: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
