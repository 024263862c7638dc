#!/usr/bin/env python3
"""Regenerate schemas/params.schema.yaml from mergepipe.config.params (the one source).

Usage: python scripts/gen_schema.py [--check]
  --check  exit 1 without writing if the committed schema is stale (for CI).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mergepipe.config.params import render_schema_yaml

SCHEMA_PATH = Path(__file__).resolve().parent.parent / "schemas" / "params.schema.yaml"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="fail if the schema file is stale instead of writing it")
    args = parser.parse_args(argv)
    text = render_schema_yaml()
    current = SCHEMA_PATH.read_text(encoding="utf-8") if SCHEMA_PATH.exists() else None
    if args.check:
        if current != text:
            print(f"{SCHEMA_PATH}: stale; run python scripts/gen_schema.py", file=sys.stderr)
            return 1
        return 0
    if current != text:
        SCHEMA_PATH.parent.mkdir(parents=True, exist_ok=True)
        SCHEMA_PATH.write_text(text, encoding="utf-8")
        print(f"wrote {SCHEMA_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
