"""The pico-Llama tokenizer family of mergekit 0.1.5's tests/test_tokenizer.py (re-expressed),
the script that runs mergekit on it, and our import-mergekit + run of one recipe: shared by the
tokenizer acceptance and chat_template tests."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from mergepipe.cli import main
from tests.helpers.equivalence import MERGEKIT_PYTHON

BUILD = r'''
import json, sys, tempfile, torch
from pathlib import Path
from tokenizers import AddedToken, Tokenizer
from transformers import LlamaConfig, LlamaForCausalLM, LlamaTokenizerFast
root = Path(sys.argv[1])
WORDS = ["<unk>", "<s>", "</s>", *(f"_tok_{i}" for i in range(3, 64))]
def tokenizer(added=(), special=None):
    spec = {"version": "1.0", "added_tokens": [],
            "model": {"type": "BPE", "vocab": {w: i for i, w in enumerate(WORDS)}, "merges": []}}
    with tempfile.TemporaryDirectory() as tmp:
        Tokenizer.from_str(json.dumps(spec)).save(f"{tmp}/tokenizer.json")
        tok = LlamaTokenizerFast(tokenizer_file=f"{tmp}/tokenizer.json")
    tok.add_tokens(list(added))
    if special is not None:
        tok.add_special_tokens({"additional_special_tokens": [special]})
    return tok
def model(name, seed, rows, tok):
    torch.manual_seed(seed)
    net = LlamaForCausalLM(LlamaConfig(vocab_size=rows, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    with torch.no_grad():  # norms start at ones: make every tensor differ between models
        for p in net.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    net.save_pretrained(root / name)
    tok.save_pretrained(root / name)
model("base", 11, 64, tokenizer())
model("chatml", 12, 66, tokenizer(["<|im_start|>", "<|im_end|>"]))
model("padded", 13, 64, tokenizer([f"<UNUSED_{i}>" for i in range(4)]))
model("special", 14, 65, tokenizer(special=AddedToken("<|existing_special|>", single_word=True, lstrip=True,
                                                      rstrip=True, normalized=False, special=True)))
'''

RUN = r'''
import json, sys, yaml
from mergekit.config import MergeConfiguration
from mergekit.merge import MergeOptions, run_merge
results = {}
for case, (path, out) in json.loads(open(sys.argv[1]).read()).items():
    try:
        run_merge(MergeConfiguration.model_validate(yaml.safe_load(open(path).read())), out,
                  options=MergeOptions(copy_tokenizer=True, write_model_card=False, quiet=True))
        results[case] = None
    except Exception as e:
        results[case] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
print(json.dumps(results))
'''


def ours(recipe: Path, folder: Path, family: Path) -> tuple[Path | None, str]:
    """import-mergekit + run of `recipe` from the family's folder: (the output or None, stderr)."""
    import contextlib
    import io
    params = folder.with_suffix(".yaml")
    err = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stderr(err):
        mp.chdir(family)
        if main(["import-mergekit", str(recipe), "-o", str(params), "-q"]) != 0:
            return None, err.getvalue()
        data = yaml.safe_load(params.read_text())
        data["output"]["dir"] = str(folder)
        data["cache_dir"] = str(folder.parent / "cache")
        params.write_text(yaml.safe_dump(data, sort_keys=False))
        if main(["run", str(params), "-q"]) != 0:
            return None, err.getvalue()
    return folder, err.getvalue()


def run_cases(root: Path, cases: dict[str, dict],
              prepare: Callable[[Path], None] | None = None) -> dict[str, tuple[Path | None, Path, str | None, str]]:
    """Builds the family under `root`, `prepare`s it, then runs every case's mergekit recipe with
    mergekit 0.1.5 (one process) and with import-mergekit + run: {case: (our output or None,
    mergekit's output folder, mergekit's error or None, our stderr)}."""
    family = root / "family"
    proc = subprocess.run([sys.executable, "-c", BUILD, str(family)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if prepare is not None:
        prepare(family)
    jobs = {}
    for case, config in cases.items():
        (root / f"{case}.yml").write_text(yaml.safe_dump(config, sort_keys=False))
        jobs[case] = (str(root / f"{case}.yml"), str(root / f"theirs-{case}"))
    (root / "jobs.json").write_text(json.dumps(jobs))
    proc = subprocess.run([str(MERGEKIT_PYTHON), "-c", RUN, str(root / "jobs.json")], capture_output=True, text=True,
                          timeout=900, cwd=family, env={**os.environ, "PYTHONHASHSEED": "0"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    their_errors = json.loads(proc.stdout.strip().splitlines()[-1])
    out = {}
    for case in cases:
        mine, error = ours(root / f"{case}.yml", root / f"ours-{case}", family)
        out[case] = (mine, root / f"theirs-{case}", their_errors[case], error)
    return out
