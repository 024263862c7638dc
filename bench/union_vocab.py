"""Peak memory of a whole `mergepipe run` whose output vocabulary is the union of the models'
(issue 26: ≤ 1.5 GB on the ~1 GB bench family with a union vocabulary of +1,000 tokens).

    .venv/bin/python bench/union_vocab.py build SRC DEST [--added 1000]
    .venv/bin/python bench/union_vocab.py measure DEST [--runs 3] [--method ties] [--out JSON]

`build`: SRC is a bench family (`mergepipe demo SRC --preset bench --experts K`); DEST gets its
base unchanged and each expert k with `--added`/2 new tokens of the `--added` new ones (expert k's
start at k * added/K, wrapping, so the union of K >= 2 experts adds all of them, in another order in
each tokenizer), appended to its tokenizer.json's added_tokens and as new rows of its embedding
(and lm_head where untied), `config.json`'s vocab_size set. Rows are seeded normal values at the
embedding's own scale.

`measure`: `--runs` runs of `mergepipe run` with `tokenizer_source: union`, each with an empty
cache (index, plan, the exact cuts a density off the grid asks for, and merge in one process), its
wall and peak RSS measured as a child process (bench/measure.py); results on stdout and as JSON.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import measure  # noqa: E402

EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def _new_tokens(k: int, n_experts: int, added: int) -> list[str]:
    start = k * added // n_experts
    return [f"<tool_{(start + j) % added}>" for j in range(added // 2)]


def _grow(tensor, rows: int, seed: int):
    import torch
    g = torch.Generator().manual_seed(seed)
    scale = float(tensor[:4096].float().std())
    extra = (torch.randn(rows, tensor.shape[1], generator=g) * scale).to(tensor.dtype)
    return torch.cat([tensor, extra])


def _expert(src: Path, dest: Path, tokens: list[str], seed: int) -> None:
    from safetensors.torch import load_file, save_file
    dest.mkdir(parents=True, exist_ok=True)
    tensors: dict = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(f))
    config = json.loads((src / "config.json").read_text())
    tok = json.loads((src / "tokenizer.json").read_text())
    first = len(tok["model"]["vocab"])
    for name in (EMBED, HEAD):
        if name in tensors:
            tensors[name] = _grow(tensors[name], len(tokens), seed + (name == HEAD))
    tok["added_tokens"] += [dict(id=first + j, content=t, single_word=False, lstrip=False, rstrip=False,
                                 normalized=False, special=False) for j, t in enumerate(tokens)]
    config["vocab_size"] = first + len(tokens)
    save_file(tensors, dest / "model.safetensors", metadata={"format": "pt"})
    (dest / "tokenizer.json").write_text(json.dumps(tok, indent=2))
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("generation_config.json", "tokenizer_config.json"):
        shutil.copy2(src / name, dest / name)


def build(src: Path, dest: Path, added: int) -> None:
    experts = sorted(p for p in src.glob("expert_*") if p.is_dir())
    if len(experts) < 2:
        raise SystemExit(f"{src}: need a family of at least two experts")
    shutil.copytree(src / "base", dest / "base", dirs_exist_ok=True)
    for k, folder in enumerate(experts):
        _expert(folder, dest / folder.name, _new_tokens(k, len(experts), added), seed=1000 + k)
        print(f"{dest / folder.name}: +{added // 2} tokens", flush=True)


def params(family: Path, out: Path, cache: Path, method: str, density: float) -> dict:
    experts = sorted(p.name for p in family.glob("expert_*") if p.is_dir())
    parameters = {"density": density} if method in ("ties", "breadcrumbs", "breadcrumbs_ties") else {}
    return {"base": str(family / "base"), "method": method, "parameters": parameters,
            "experts": [{"name": e, "path": str(family / e), "weight": round(1 / len(experts), 6)} for e in experts],
            "output": {"dir": str(out), "tokenizer_source": "union"}, "cache_dir": str(cache)}


def measure_runs(family: Path, runs: int, method: str, threads: int, density: float) -> list[dict]:
    import yaml
    results = []
    measure.warm([p for d in family.iterdir() if d.is_dir() for p in measure.model_files(d)])
    for run in range(runs):
        with tempfile.TemporaryDirectory(prefix="bench-union-") as tmp:
            work = Path(tmp)
            cfg = work / "params.yaml"
            recipe = params(family, work / "out", work / "cache", method, density)
            cfg.write_text(yaml.safe_dump(recipe, sort_keys=False))
            argv = [sys.executable, "-m", "mergepipe", "run", str(cfg), "-q", "--threads", str(threads)]
            m = measure.run_measured(argv, log=work / "stderr.log")
            if m.returncode != 0:
                raise SystemExit(f"run {run}: exit {m.returncode}: {m.stderr_tail}")
            man = json.loads((work / "out" / "manifest.json").read_text())
            vocab = man["plan"]["output"]["vocabulary"]
            row = {"run": run, "method": method, "density": density, "cuts": "cuts" in man["plan"],
                   "wall_s": round(m.wall_s, 3),
                   "peak_rss_mib": round(m.max_rss_bytes / 2**20, 1),
                   "peak_anon_mib": round(m.peak_rss_anon_bytes / 2**20, 1),
                   "peak_file_mib": round(m.peak_rss_file_bytes / 2**20, 1), "loadavg_before": m.loadavg_before,
                   "vocabulary_size": vocab["size"], "vocabulary_rows": vocab["rows"], "plan_hash": man["plan_hash"]}
            print(json.dumps(row), flush=True)
            results.append(row)
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("src", type=Path)
    b.add_argument("dest", type=Path)
    b.add_argument("--added", type=int, default=1000)
    m = sub.add_parser("measure")
    m.add_argument("family", type=Path)
    m.add_argument("--runs", type=int, default=3)
    m.add_argument("--method", default="ties")
    m.add_argument("--threads", type=int, default=2)
    m.add_argument("--density", type=float, default=0.5, help="ties/breadcrumbs density (0.333: off the grid)")
    m.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if args.cmd == "build":
        build(args.src, args.dest, args.added)
        return 0
    results = measure_runs(args.family, args.runs, args.method, args.threads, args.density)
    if args.out:
        args.out.write_text(json.dumps({"family": str(args.family), "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
