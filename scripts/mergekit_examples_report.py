#!/usr/bin/env python3
"""Report how many mergekit YAML configurations in a folder `mergepipe import-mergekit` takes.

Usage: python scripts/mergekit_examples_report.py FOLDER [--run] [--json]

For each *.yml / *.yaml file (sorted), one line: `imports` when the configuration converts
to a valid params.yaml (the grammar: models are not looked up), else `refused: <the
one-line reason>`. With --run, a configuration that imports and whose models are all local
folders (relative to the config's folder, where it is run from, as mergekit reads them against
its working directory) or in the Hugging Face cache is also run (`mergepipe run` into a temporary folder,
removed afterwards): `ran`, or `run failed: <reason>`; otherwise `models not available`.
The last line is the share that imports (and, with --run, that ran).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
from pathlib import Path

from mergepipe.config.mergekit import mergekit_to_params, resolve_model_ref, write_params
from mergepipe.config.params import config_from_dict, read_yaml
from mergepipe.errors import MergepipeError


def _strip(message: str, source: str) -> str:
    """The reason without the file name the error starts with."""
    for prefix in (f"{source}: ", f"{source} (converted to mergepipe params): "):
        if message.startswith(prefix):
            return message[len(prefix):]
    return message


def check_import(path: Path) -> str | None:
    """None when `path` imports (grammar and params validation), else the reason."""
    source = str(path)
    try:
        # a stacking config (passthrough slices) converts to a passthrough of the folder that
        # import-mergekit builds; the grammar check only names it
        params = mergekit_to_params(read_yaml(path), source=source, stack_dir="stacked")
        config_from_dict(params, source=source, root=path.parent)
    except MergepipeError as err:
        return _strip(str(err).splitlines()[0], source)
    return None


def try_run(path: Path) -> str:
    """`ran`, `run failed: <reason>`, or `models not available`, for a config that imports. Run
    as from the config's folder: mergekit reads model paths against its working directory."""
    from mergepipe.cli import main
    source = str(path.resolve())
    data = read_yaml(path)
    refs = [data.get("base_model"), *(m.get("model") if isinstance(m, dict) else m for m in data.get("models") or []),
            *(s.get("model") for sl in data.get("slices") or [] for s in sl.get("sources") or [])]
    with contextlib.chdir(path.parent), tempfile.TemporaryDirectory(prefix="mk-report-") as tmp:
        for ref in filter(None, refs):
            try:
                if not resolve_model_ref(ref, "model", source).is_dir():
                    return "models not available"
            except MergepipeError:
                return "models not available"
        cfg = Path(tmp) / "params.yaml"  # its model paths are written relative to its folder
        errors = io.StringIO()
        with contextlib.redirect_stderr(errors):  # import-mergekit builds a stack where there is one
            code = main(["import-mergekit", source, "-o", str(cfg), "-q"])
        if code != 0:
            return f"run failed: {_strip(errors.getvalue().strip().removeprefix('mergepipe: error: '), source)}"
        params = read_yaml(cfg)
        params = {**params, "output": {**params["output"], "dir": str(Path(tmp) / "out")},
                  "cache_dir": str(Path(tmp) / "cache")}
        write_params(params, cfg)
        code = main(["run", str(cfg), "-q"])
    return "ran" if code == 0 else f"run failed: exit {code}"


def report(folder: Path, *, run: bool = False) -> dict:
    """{files: [{file, imports, reason, run}], imported, ran, total}."""
    rows = []
    for path in sorted([*folder.glob("*.yml"), *folder.glob("*.yaml")]):
        reason = check_import(path)
        row = {"file": path.name, "imports": reason is None, "reason": reason, "run": None}
        if run and reason is None:
            row["run"] = try_run(path)
        rows.append(row)
    return {"files": rows, "total": len(rows), "imported": sum(r["imports"] for r in rows),
            "ran": sum(r["run"] == "ran" for r in rows)}


def render(result: dict, *, run: bool = False) -> str:
    lines = []
    for r in result["files"]:
        status = "imports" if r["imports"] else f"refused: {r['reason']}"
        if run and r["imports"]:
            status += f"; {r['run']}"
        lines.append(f"{r['file']}: {status}")
    total = result["total"] or 1
    summary = f"{result['imported']} of {result['total']} import ({100 * result['imported'] / total:.0f}%)"
    if run:
        summary += f"; {result['ran']} ran"
    return "\n".join([*lines, summary]) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--run", action="store_true", help="also run those whose models are available")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    if not args.folder.is_dir():
        print(f"{args.folder}: not a folder", file=sys.stderr)
        return 2
    result = report(args.folder, run=args.run)
    sys.stdout.write(json.dumps(result, indent=1) + "\n" if args.json else render(result, run=args.run))
    return 0


if __name__ == "__main__":
    sys.exit(main())
