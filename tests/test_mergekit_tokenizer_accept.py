"""Acceptance: every case of mergekit 0.1.5's tests/test_tokenizer.py (13 in 10 tests), run
through `mergepipe import-mergekit` + `mergepipe run`, against mergekit's own output.

The family is the one those tests build (re-expressed here): pico Llamas whose tokenizers are
a BPE vocabulary `<unk> <s> </s> _tok_3 ... _tok_63` with `base` (64 rows), `chatml` adding
`<|im_start|>` and `<|im_end|>` (66 rows), `padded` adding four `<UNUSED_k>` tokens beyond its
64 rows, and `special` adding one special token with every AddedToken attribute set (65 rows).
Each case's mergekit YAML is the configuration that test builds (every model weight 1.0,
`dtype: float32`). mergekit runs all of them in one process; for each case the outputs must
agree: the tokenizer's vocabulary (token -> id) and added tokens with their attributes, config.json's
vocab_size, every tensor by the rule of tests/helpers/equivalence.py (one ulp of the larger value), and the
output loads with transformers' AutoTokenizer and AutoModelForCausalLM and encodes a text
holding the added tokens to mergekit's ids. A case mergekit refuses must be refused by import or run
in one line. The cases that differ today are marked (DIFFERS, with why). Skipped without the
mergekit reference venv.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.equivalence import EPS32, INSTALL, MERGEKIT_PYTHON, judge
from tests.helpers import load_model
from tests.helpers.mergekit_tokenizers import run_cases

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not MERGEKIT_PYTHON.exists(),
                       reason=f"mergekit reference venv not found at {MERGEKIT_PYTHON}; create it with: {INSTALL}"),
]


ENCODE = r'''
import json, sys
from transformers import AutoModelForCausalLM, AutoTokenizer
text = sys.argv[2]
out = {}
for folder in sys.argv[3:]:
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    out[folder] = {"ids": tok(text)["input_ids"], "rows": int(model.get_input_embeddings().weight.shape[0]),
                   "added": {str(i): [t.content, t.single_word, t.lstrip, t.rstrip, t.normalized, t.special]
                             for i, t in sorted(tok.added_tokens_decoder.items())}}
print(json.dumps(out))
'''

# an fp32 output may also be within two fp32 roundings of the magnitudes summed: linear and slerp
# take each model as base + delta, each delta rounded once in fp32 (docs/design.md, "Equivalence
# with mergekit", grants the joint methods the same in fp32)
FP32_ROUNDINGS = 2
TEXT = "<s> _tok_5<|im_start|>_tok_7 <|im_end|> <|existing_special|> _tok_10<|new_configured_token|>"


def _case(models: list[str], *, method: str = "linear", base: str = "base", t: float | None = None,
          tokenizer_source: str | None = None, tokenizer: dict | None = None) -> dict:
    """The configuration mergekit's make_config builds, models named by family folder."""
    return {"merge_method": method, "base_model": base, "dtype": "float32",
            "models": [{"model": m, "parameters": {"weight": 1.0}} for m in models],
            "parameters": {} if t is None else {"t": t},
            **({} if tokenizer_source is None else {"tokenizer_source": tokenizer_source}),
            **({} if tokenizer is None else {"tokenizer": tokenizer})}


def _special_tokens(source: str, missing: bool) -> dict:
    tokens = {"<|existing_special|>": {"source": "special", "force": True}}
    if missing:
        tokens["<|new_configured_token|>"] = {
            "source": {"kind": "model_token", "model": "special", "token": "_tok_10"}, "force": True}
    return {"source": source, "tokens": tokens}


CASES = {
    "mismatched_vocabulary_requires_alignment": _case(["base", "padded", "chatml"]),
    "source_base": _case(["base", "padded", "chatml"], tokenizer_source="base"),
    "task_arithmetic_aligns[base]": _case(["base", "chatml"], method="task_arithmetic", tokenizer={"source": "base"}),
    "task_arithmetic_aligns[union]": _case(["base", "chatml"], method="task_arithmetic",
                                           tokenizer={"source": "union"}),
    "source_union": _case(["base", "padded", "chatml"], tokenizer_source="union"),
    "source_model": _case(["base", "padded", "chatml"], tokenizer_source="chatml"),
    "slerp_union": _case(["base", "chatml"], method="slerp", t=0.5, tokenizer_source="union"),
    "force_token": _case(["base", "chatml"], tokenizer={"source": "union", "tokens": {
        "_tok_10": {"source": "chatml", "force": True}, "_tok_11": {"source": "base", "force": True}}}),
    "configured_tokens[model-with-missing]": _case(["special"], base="special",
                                                   tokenizer=_special_tokens("special", True)),
    "configured_tokens[base]": _case(["special"], base="special", tokenizer=_special_tokens("base", False)),
    "configured_tokens[union]": _case(["special"], base="special", tokenizer=_special_tokens("union", False)),
    "model_token_id": _case(["base", "chatml"], tokenizer={"source": "base", "tokens": {
        "_tok_20": {"source": {"kind": "model_token", "model": "chatml", "token_id": 64}, "force": True},
        "_tok_21": {"source": {"kind": "model_token", "model": "base", "token": "<s>"}, "force": True}}}),
    "pad_to_multiple_of": _case(["chatml"], base="chatml", tokenizer={"source": "base", "pad_to_multiple_of": 16}),
}


# Cases that differ today (strict: each turns into a failure once it matches, to be unmarked): none
# (tokenizer_source base or a model over vocabularies of other sizes: output.align_vocabulary)
DIFFERS: dict[str, str] = {}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[Path, Path | None, str | None, str]]:
    """{case: (our output folder or None, mergekit's output folder, mergekit's error, our error)};
    model names are family folders, read against the family's folder by both tools."""
    return run_cases(tmp_path_factory.mktemp("mk_tokenizer"), CASES)


def _vocab(folder: Path) -> dict[str, int]:
    tok = json.loads((folder / "tokenizer.json").read_text())
    return {**tok["model"]["vocab"], **{e["content"]: e["id"] for e in tok["added_tokens"]}}


def _scales(config: dict, family: Path, theirs: Path, ref: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The rule's bound on the magnitudes summed into each output element (as
    tests/test_mergekit_basic_merges.py: the inputs' |x| summed, times the weights' sum): each
    model's row of an output token where it has the token, mergekit's output row where it lacks
    it (the row it was given, a base's or a mean: of that magnitude); a padding row the largest of
    the rows it is the mean of."""
    out_ids = _vocab(theirs)
    models = list(dict.fromkeys([config["base_model"], *(m["model"] for m in config["models"])]))
    total = {name: torch.zeros(t.shape, dtype=torch.float64) for name, t in ref.items()}
    for model in models:
        tensors, ids = load_model(family / model), _vocab(family / model)
        for name, acc in total.items():
            x = tensors[name].double().abs()
            if x.shape == acc.shape and not _is_vocab(name):
                acc += x
                continue
            for token, row in out_ids.items():
                acc[row] += x[ids[token]] if ids.get(token, x.shape[0]) < x.shape[0] else ref[name][row].double().abs()
    for name, acc in total.items():  # a padding row is a mean of the rows: bounded by their largest
        if _is_vocab(name) and acc.shape[0] > len(out_ids):
            acc[len(out_ids):] = acc[:len(out_ids)].amax(0)
    spread = max(1.0, float(len(config["models"])))
    return {name: acc * spread for name, acc in total.items()}


def _is_vocab(name: str) -> bool:
    return name.endswith(("embed_tokens.weight", "lm_head.weight"))


def _loaded(folders: list[Path]) -> dict[str, dict]:
    proc = subprocess.run([sys.executable, "-c", ENCODE, "", TEXT, *map(str, folders)], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.xfail(strict=True, reason=DIFFERS[c]))
                                  if c in DIFFERS else c for c in CASES])
def test_tokenizer_case_matches_mergekit(case, runs):
    ours, theirs, their_error, our_error = runs[case]
    if their_error is not None:
        assert ours is None, f"mergekit refused this configuration ({their_error}); mergepipe merged it"
        assert len(our_error.strip().splitlines()) == 1, our_error
        return
    assert ours is not None, f"mergekit merges this configuration; mergepipe refused it: {our_error.strip()}"
    assert _vocab(ours) == _vocab(theirs)
    vocab_sizes = [json.loads((f / "config.json").read_text())["vocab_size"] for f in (ours, theirs)]
    assert vocab_sizes[0] == vocab_sizes[1]
    mine, ref = load_model(ours), load_model(theirs)
    assert sorted(mine) == sorted(ref)
    scales = _scales(CASES[case], ours.parent / "family", theirs, ref)
    for name, tensor in ref.items():
        assert mine[name].dtype == tensor.dtype and mine[name].shape == tensor.shape, name
        verdict = judge(mine[name].reshape(-1), tensor.reshape(-1), scale=scales[name].reshape(-1))
        beyond = (mine[name].double() - tensor.double()).abs() > FP32_ROUNDINGS * EPS32 * scales[name]
        assert verdict.misses == 0 or (tensor.dtype == torch.float32 and not bool(beyond.any())), f"{name}: {verdict}"
    loaded = _loaded([ours, theirs])
    assert loaded[str(ours)] == loaded[str(theirs)]
    assert loaded[str(ours)]["rows"] == vocab_sizes[0]
