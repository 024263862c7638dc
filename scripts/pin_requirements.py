#!/usr/bin/env python3
"""Write envs/requirements.txt: exact pins of what a cluster node needs, from this environment.

A node runs Snakemake's job steps and the mergepipe CLI, so the pins are the installed
versions of mergepipe's dependencies, snakemake and its executor plugins, and everything
they require (transitively). DVC and the test/bench tools stay off the nodes.

Usage: .venv/bin/python scripts/pin_requirements.py [--check]
  --check  exit 1 without writing if envs/requirements.txt differs from this environment.
"""
from __future__ import annotations

import argparse
import re
import sys
from importlib import metadata
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "envs" / "requirements.txt"
ROOTS = ["mergepipe", "snakemake", "snakemake-executor-plugin-slurm", "snakemake-executor-plugin-cluster-generic"]
HEADER = """\
# Exact versions for cluster nodes (mergepipe's dependencies, snakemake and its executor
# plugins, transitively), written by scripts/pin_requirements.py from the environment the
# tests ran in. Install with: pip install -r envs/requirements.txt && pip install --no-deps -e .
# torch is the CPU wheel's version; on GPU nodes install the matching CUDA build of it.
"""


def _canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirements(dist: metadata.Distribution) -> list[str]:
    """Names this distribution requires in a plain install (no extras), for this platform."""
    names = []
    for req in dist.requires or []:
        spec, _, marker = req.partition(";")
        if "extra" in marker:
            continue
        if marker.strip():
            try:
                from packaging.markers import Marker
                if not Marker(marker).evaluate():
                    continue
            except Exception:  # noqa: BLE001 - no packaging, or an odd marker: keep it
                pass
        names.append(_canon(re.split(r"[\s<>=!~\[(;]", spec.strip(), maxsplit=1)[0]))
    return names


def closure() -> dict[str, str]:
    pins: dict[str, str] = {}
    todo = [_canon(r) for r in ROOTS]
    while todo:
        name = todo.pop()
        if name in pins:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # an optional dependency that is not installed here
        pins[name] = dist.version.split("+", 1)[0]  # torch 2.13.0+cpu: the index's label, not the version
        todo.extend(_requirements(dist))
    pins.pop("mergepipe", None)  # installed from the checkout itself
    return dict(sorted(pins.items()))


def render() -> str:
    return HEADER + "".join(f"{name}=={version}\n" for name, version in closure().items())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not OUT.is_file() or OUT.read_text() != text:
            print(f"{OUT}: differs from this environment; run scripts/pin_requirements.py", file=sys.stderr)
            return 1
        return 0
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    print(f"wrote {OUT} ({text.count('==')} pins)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
