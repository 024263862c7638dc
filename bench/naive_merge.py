"""Naive full-read merge: the baseline that reads every byte of every expert.

A deliberately small reference (no index, no plan, no block skipping): for each
tensor in the base's order it preads the whole tensor from the base and from
every expert, merges in fp32 and writes the output dtype sequentially into one
.safetensors file whose header is written first. Methods: task_arithmetic and
ties (mergekit semantics; the TIES threshold is the k-th largest |delta| by
torch.kthvalue, keeping every element >= it, so at a tie it may keep a few more
than k, which mergepipe does not). Standalone on purpose: it imports nothing
from mergepipe, so the baseline cannot inherit mergepipe's I/O.

    python bench/naive_merge.py --method ties --density 0.5 --base B \
        --expert E1:1.0 --expert E2:0.5 -o OUT
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from math import prod
from pathlib import Path

import torch

DT = {"BF16": (torch.bfloat16, 2), "F16": (torch.float16, 2), "F32": (torch.float32, 4)}


def tensors_of(folder: Path) -> dict[str, tuple[Path, str, list[int], int, int]]:
    """name -> (file, dtype, shape, absolute begin, end), from the headers only."""
    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() \
        else ["model.safetensors"]
    out = {}
    for fname in files:
        path = folder / fname
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        for name, e in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            b, end = e["data_offsets"]
            out[name] = (path, e["dtype"], e["shape"], 8 + n + b, 8 + n + end)
    return out


class Reader:
    def __init__(self) -> None:
        self.fds: dict[Path, int] = {}
        self.bytes_read = 0

    def read(self, entry) -> torch.Tensor:
        path, dtype, shape, begin, end = entry
        fd = self.fds.get(path)
        if fd is None:
            fd = self.fds[path] = os.open(path, os.O_RDONLY)
        buf = bytearray(end - begin)
        view, got = memoryview(buf), 0
        while got < len(buf):
            got += os.preadv(fd, [view[got:]], begin + got)
        self.bytes_read += len(buf)
        if not buf:
            return torch.empty(shape, dtype=DT[dtype][0])
        return torch.frombuffer(buf, dtype=DT[dtype][0]).reshape(shape)


def merge_tensor(base: torch.Tensor, experts: list[torch.Tensor], weights: list[float], *,
                 method: str, density: float, lam: float, normalize: bool) -> torch.Tensor:
    w0 = base.float()
    deltas = [e.float() - w0 for e in experts]
    if method == "ties" and density < 1:
        pruned = []
        for d in deltas:
            n = d.numel()
            k = max(1, int(density * n))
            mag = d.abs().reshape(-1)
            threshold = torch.kthvalue(mag, n - k + 1).values
            pruned.append(d * (d.abs() >= threshold))
        deltas = pruned
    weighted = [d * torch.tensor(w, dtype=torch.float32) for d, w in zip(deltas, weights)]
    if method == "ties":
        total = weighted[0].clone()
        for t in weighted[1:]:
            total += t
        sign = (total >= 0).float() * 2 - 1
        mixed = torch.zeros_like(w0)
        divisor = torch.zeros_like(w0)
        for t, w in zip(weighted, weights):
            agree = t.sign() == sign
            mixed += t * agree
            divisor += w * agree
        divisor[divisor == 0] = 1
    else:
        mixed = weighted[0].clone()
        for t in weighted[1:]:
            mixed += t
        divisor = torch.tensor(sum(weights) or 1.0)
    if normalize:
        mixed = mixed / divisor
    return w0 + lam * mixed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--method", choices=["task_arithmetic", "ties"], required=True)
    ap.add_argument("--base", required=True)
    ap.add_argument("--expert", action="append", required=True, help="PATH:WEIGHT")
    ap.add_argument("--density", type=float, default=1.0)
    ap.add_argument("--lambda", dest="lam", type=float, default=1.0)
    ap.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=None)
    ap.add_argument("-o", required=True)
    args = ap.parse_args(argv)
    normalize = args.normalize if args.normalize is not None else args.method == "ties"
    base_dir = Path(args.base)
    experts = [(Path(p), float(w)) for p, _, w in (e.rpartition(":") for e in args.expert)]
    base_t = tensors_of(base_dir)
    exp_t = [tensors_of(p) for p, _ in experts]
    weights = [w for _, w in experts]
    out_dir = Path(args.o)
    out_dir.mkdir(parents=True, exist_ok=True)
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, (_, dtype, shape, b, e) in base_t.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + e - b]}
        offset += e - b
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    reader = Reader()
    torch.set_num_threads(os.cpu_count() or 1)
    with open(out_dir / "model.safetensors", "wb") as out:
        out.write(len(raw).to_bytes(8, "little") + raw)
        for name, entry in base_t.items():
            base = reader.read(entry)
            exps = [reader.read(t[name]) for t in exp_t]
            if entry[1] in DT and prod(entry[2]) > 0:
                merged = merge_tensor(base, exps, weights, method=args.method, density=args.density,
                                      lam=args.lam, normalize=normalize).to(base.dtype)
            else:
                merged = base
            out.write(merged.contiguous().view(torch.uint8).numpy().tobytes() if merged.numel() else b"")
        out.flush()
        os.fsync(out.fileno())
    for aux in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        if (base_dir / aux).is_file():
            shutil.copyfile(base_dir / aux, out_dir / aux)
    print(json.dumps({"bytes_read": reader.bytes_read}), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
