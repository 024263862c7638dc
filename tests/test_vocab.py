"""Vocabularies that differ (docs/design.md, "Vocabularies"): every model seen in the output
vocabulary, as mergekit 0.1.5 rebuilds it (`tokenizer_source: union`, `tokens:`,
`pad_to_multiple_of`).

The family: a tiny fp32 Llama base of 63 tokens (a WordLevel tokenizer), `chat` adding two
special tokens (65 rows), `pad` the base's tokenizer with its rows padded to 64, `tool` adding
`<|im_end|>` and a plain `<tool>` (65 rows): `<|im_start|>` then comes from chat alone,
`<|im_end|>` is the mean of chat's and tool's rows, `<tool>` tool's. mergekit orders its union
by a set of models (PYTHONHASHSEED), so rows are compared token by token through each output's
tokenizer.json, by the rule of tests/helpers/equivalence.py (one ulp of the larger value), mergekit
run with a PYTHONHASHSEED that gives our ids (a padding row's mean is summed in id order).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import yaml

from mergepipe.checkpoint.safetensors import CheckpointReader, as_tensor, open_checkpoint
from mergepipe.checkpoint.vocab import VocabCheckpoint
from mergepipe.cli import main
from mergepipe.commands.vocabulary import Recipe, build, config_recipe, in_content_order
from mergepipe.config.params import load_config
from mergepipe.checkpoint.vocab import open_view
from tests.helpers.equivalence import MERGEKIT_PYTHON, judge, merge_scale
from tests.helpers import load_model

BUILD = r'''
import sys, torch
from pathlib import Path
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
root = Path(sys.argv[1])
def tokenizer(added):
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(60)}}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    t.add_special_tokens([AddedToken(s, special=True) for s in ("<unk>", "<s>", "</s>")])
    for content, special in added:
        (t.add_special_tokens if special else t.add_tokens)([AddedToken(content, special=special)])
    return PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
def build(name, seed, rows, added=()):
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=rows, hidden_size=32, intermediate_size=48, num_attention_heads=4,
                                         num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=64,
                                         tie_word_embeddings=False))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.save_pretrained(root / name)
    tokenizer(added).save_pretrained(root / name)
build("base", 1, 63)
build("chat", 2, 65, [("<|im_start|>", True), ("<|im_end|>", True)])
build("pad", 3, 64)
build("tool", 4, 65, [("<|im_end|>", True), ("<tool>", False)])
'''

RUN = r'''
import sys, yaml
from mergekit.config import MergeConfiguration
from mergekit.merge import MergeOptions, run_merge
run_merge(MergeConfiguration.model_validate(yaml.safe_load(open(sys.argv[1]).read())), sys.argv[2],
          options=MergeOptions(copy_tokenizer=True, write_model_card=False, quiet=True))
'''

EXPERTS = {"chat": 0.6, "pad": 0.5, "tool": 0.4}
needs_mergekit = pytest.mark.skipif(not MERGEKIT_PYTHON.exists(), reason="mergekit reference venv not found")


@pytest.fixture(scope="module")
def family(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("vocab_family")
    proc = subprocess.run([sys.executable, "-c", BUILD, str(root)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root


def _params(family: Path, tmp: Path, *, method: str = "task_arithmetic", parameters: dict | None = None,
            order: list[str] | None = None, **output) -> Path:
    params = {"base": str(family / "base"), "method": method, "parameters": parameters or {},
              "experts": [{"name": n, "path": str(family / n), "weight": EXPERTS[n]} for n in order or EXPERTS],
              "output": {"dir": str(tmp / "out"), **output}, "cache_dir": str(tmp / "cache")}
    path = tmp / "params.yaml"
    path.write_text(yaml.safe_dump(params, sort_keys=False))
    return path


def _mergekit(family: Path, tmp: Path, *, method: str = "task_arithmetic", parameters: dict | None = None,
              **extra) -> Path:
    """mergekit's merge of the family, its models listed in our plan's order (tmp/out's manifest):
    both then sum the experts' terms in one order (mergekit's union order is its own)."""
    order = [e["name"] for e in json.loads((tmp / "out" / "manifest.json").read_text())["plan"]["experts"]]
    config = {"merge_method": method, "base_model": str(family / "base"), "dtype": "float32",
              "parameters": parameters or {},
              "models": [{"model": str(family / n), "parameters": {"weight": EXPERTS[n]}} for n in order],
              **extra}
    path = tmp / "mergekit.yml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    # mergekit's union order is a Python set's (PYTHONHASHSEED); a padding row is a mean over the
    # rows in id order, whose rounding follows that order: take a seed that gives our ids
    for seed in range(16):
        out = tmp / f"theirs-{seed}"
        proc = subprocess.run([str(MERGEKIT_PYTHON), "-c", RUN, str(path), str(out)], capture_output=True,
                              text=True, timeout=600, env={**os.environ, "PYTHONHASHSEED": str(seed)})
        assert proc.returncode == 0, proc.stderr[-3000:]
        if _vocab(out) == _vocab(tmp / "out"):
            return out
    pytest.fail("no PYTHONHASHSEED in 0..15 gives mergekit's union our token order")


def _vocab(folder: Path) -> dict[str, int]:
    tok = json.loads((folder / "tokenizer.json").read_text())
    return {**tok["model"]["vocab"], **{e["content"]: e["id"] for e in tok["added_tokens"]}}


def _in_vocab(folder: Path, tensors: dict[str, torch.Tensor], tokens: list[str]) -> dict[str, torch.Tensor]:
    """The vocabulary tensors' rows of `tokens` in order, then the padding rows; others as they are."""
    ids = _vocab(folder)
    rows = torch.tensor([ids[t] for t in tokens])
    return {k: torch.cat([v[rows], v[len(ids):]]) if k.endswith(("embed_tokens.weight", "lm_head.weight")) else v
            for k, v in tensors.items()}


def _compare(ours: Path, theirs: Path, family: Path, **recipe) -> None:
    """Ours and theirs token by token; the rule's magnitudes from the inputs in the output
    vocabulary (our views: only the tolerance, the rows are checked by test_each_view_row...)."""
    tokens = sorted(_vocab(ours))
    assert tokens == sorted(_vocab(theirs))
    assert json.loads((ours / "config.json").read_text())["vocab_size"] == \
        json.loads((theirs / "config.json").read_text())["vocab_size"]
    mine, ref = _in_vocab(ours, load_model(ours), tokens), _in_vocab(theirs, load_model(theirs), tokens)
    assert sorted(mine) == sorted(ref)
    _, views = _views(family, **recipe)
    inputs = {n: _in_vocab(ours, {t: _rows(v, t) for t in v.tensors}, tokens) for n, v in views.items()}
    n = len(tokens)
    for name in mine:
        assert mine[name].shape == ref[name].shape, name
        a, b = mine[name], ref[name]
        vocabulary = name.endswith(("embed_tokens.weight", "lm_head.weight"))
        if vocabulary and a.shape[0] > n:  # padding rows: each model's mean row, ours fp64 in id order,
            pad_in = torch.stack([inputs[m][name][n:] for m in ("base", *EXPERTS)]).double().abs().max()
            # mergekit's torch.mean; each input row within a few ulps, the merge adds at most 2x that
            assert float((a[n:].double() - b[n:].double()).abs().max()) <= 16 * torch.finfo(a.dtype).eps * float(pad_in)
            a, b = a[:n], b[:n]
        scale = merge_scale(*((inputs["base"][name][:n] if vocabulary else inputs["base"][name]),),
                            [inputs[m][name][:n] if vocabulary else inputs[m][name] for m in EXPERTS],
                            list(EXPERTS.values()))
        verdict = judge(a.flatten(), b.flatten(), scale=scale.flatten())
        assert verdict.misses == 0, f"{name}: {verdict}"


@needs_mergekit
@pytest.mark.parametrize("method, parameters", [("task_arithmetic", {}), ("ties", {"density": 1.0})])
def test_union_merge_equals_mergekits(family, tmp_path, method, parameters):
    assert main(["run", str(_params(family, tmp_path, method=method, parameters=parameters,
                                    tokenizer_source="union")), "-q"]) == 0
    theirs = _mergekit(family, tmp_path, method=method, parameters=parameters, tokenizer_source="union")
    _compare(tmp_path / "out", theirs, family, order=True)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["vocab_size"] == 66


TOKENS = {"<tool>": {"source": {"kind": "model_token", "model": "chat", "token_id": 64}},
          "<|im_end|>": {"source": {"kind": "model_token", "model": "base", "token": "w5"}, "force": True},
          "<extra>": {"source": {"kind": "zero"}}}


@needs_mergekit
def test_tokens_and_padding_equal_mergekits(family, tmp_path):
    assert main(["run", str(_params(family, tmp_path, tokenizer_source="union", tokens=TOKENS,
                                    pad_to_multiple_of=64)), "-q"]) == 0
    mk_tokens = {t: {**spec, "source": {**spec["source"], "model": str(family / spec["source"]["model"])}
                     if "model" in spec["source"] else spec["source"]} for t, spec in TOKENS.items()}
    theirs = _mergekit(family, tmp_path, tokenizer={"source": "union", "tokens": mk_tokens, "pad_to_multiple_of": 64})
    _compare(tmp_path / "out", theirs, family, order=True, tokens=TOKENS, pad=64)
    out = load_model(tmp_path / "out")
    assert out["model.embed_tokens.weight"].shape[0] == 128


def _views(family: Path, *, source: str = "union", tokens: dict | None = None, pad: int | None = None,
           order: bool = False) -> tuple:
    """Every model's view (checkpoint/vocab.py); `order`: experts in content order, as a merge has them."""
    models = {"base": family / "base", **{n: family / n for n in EXPERTS}}
    recipe = Recipe(source, None, tokens or {}, pad, models)
    if order:
        from mergepipe.index.store import Store
        with tempfile.TemporaryDirectory() as cache:
            recipe = in_content_order(recipe, Store(cache).own_models(models, block_bytes=1 << 20)[1])
    vocab, _ = build(recipe)
    donors = {n: open_checkpoint(p) for n, p in models.items()}
    return vocab, {n: open_view(n, vocab, donors) for n in models}


def _rows(ckpt, name: str = "model.embed_tokens.weight") -> torch.Tensor:
    t = ckpt.tensors[name]
    with CheckpointReader(ckpt) as r:
        return as_tensor(r.read_range(t, t.begin, t.end), t.dtype, t.shape).clone()


def test_each_view_row_follows_mergekits_rule(family):
    vocab, views = _views(family, pad=64)
    own = {n: load_model(family / n)["model.embed_tokens.weight"] for n in views}
    ids = {t: i for i, t in enumerate(vocab.tokens)}
    assert vocab.tokens[63:] == ["<|im_start|>", "<|im_end|>", "<tool>"] and vocab.rows == 128
    for name, view in views.items():
        assert isinstance(view, VocabCheckpoint)
        rows = _rows(view)
        assert torch.equal(rows[:63], own[name][:63])  # every base token: its own row
        assert torch.equal(rows[ids["<|im_start|>"]], own["chat"][63])  # chat alone has it
        assert torch.equal(rows[ids["<tool>"]], own["tool"][64])  # tool alone has it
        mean = (torch.zeros(32) + own["chat"][64] + own["tool"][63]) / 2
        assert torch.equal(rows[ids["<|im_end|>"]], own[name][63 if name == "tool" else 64] if name in ("chat", "tool")
                           else mean)
        acc = torch.zeros(32, dtype=torch.float64)
        for r in rows[:66]:  # padding: the mean row, summed in fp64 in id order
            acc += r.double()
        assert torch.equal(rows[66:], (acc / 66).float().to(rows.dtype).expand(62, 32))
        gap = (rows[66].double() - torch.mean(rows[:66], dim=0).double()).abs()
        assert bool((gap <= torch.finfo(rows.dtype).eps * rows[:66].double().abs().max()).all())  # mergekit's mean
        assert torch.equal(_rows(view, "lm_head.weight")[ids["<|im_start|>"]],
                           load_model(family / "chat")["lm_head.weight"][63])
    # every other tensor: the model's own bytes, read from its own file
    assert torch.equal(_rows(views["chat"], "model.norm.weight"), load_model(family / "chat")["model.norm.weight"])


def test_a_model_in_the_output_vocabulary_is_no_view(family):
    vocab, views = _views(family, source="base")  # the base's 63 tokens: its own rows, in order
    assert not isinstance(views["base"], VocabCheckpoint)
    assert views["pad"].tensors["model.embed_tokens.weight"].shape == (63, 32)  # its padding row dropped


def test_output_tokenizer_encodes_the_added_tokens(family, tmp_path):
    from transformers import AutoTokenizer
    assert main(["run", str(_params(family, tmp_path, tokenizer_source="union")), "-q"]) == 0
    out = tmp_path / "out"
    tok = AutoTokenizer.from_pretrained(out)
    ids = _vocab(out)
    assert len(tok) == 66 == json.loads((out / "config.json").read_text())["vocab_size"]
    assert tok.encode("<|im_start|> w1 <tool> <|im_end|>", add_special_tokens=False) == \
        [ids["<|im_start|>"], ids["w1"], ids["<tool>"], ids["<|im_end|>"]]
    assert {ids["<|im_start|>"], ids["<tool>"], ids["<|im_end|>"]} == {63, 64, 65}
    assert tok.convert_ids_to_tokens(ids["<tool>"]) == "<tool>"
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.get_input_embeddings().weight.shape == (66, 32)


def test_expert_order_and_plan_replay_change_no_byte(family, tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir(), second.mkdir()
    assert main(["run", str(_params(family, first, tokenizer_source="union", pad_to_multiple_of=64)), "-q"]) == 0
    params = _params(family, second, order=["tool", "pad", "chat"], tokenizer_source="union", pad_to_multiple_of=64)
    assert main(["run", str(params), "-q"]) == 0
    assert (first / "out" / "model.safetensors").read_bytes() == (second / "out" / "model.safetensors").read_bytes()
    assert (first / "out" / "tokenizer.json").read_bytes() == (second / "out" / "tokenizer.json").read_bytes()
    plan = tmp_path / "plan.json"
    assert main(["plan", str(params), "-o", str(plan), "-q"]) == 0
    assert main(["merge", str(plan), "-o", str(tmp_path / "replayed"), "--cache-dir", str(tmp_path / "c2"), "-q"]) == 0
    assert (tmp_path / "replayed" / "model.safetensors").read_bytes() == \
        (first / "out" / "model.safetensors").read_bytes()
    record = json.loads(plan.read_text())["output"]["vocabulary"]
    assert record["rows"] == 128 and record["size"] == 66
    rules = {token: rule for _, token, rule in record["filled"]}
    assert rules["<|im_start|>"] == "chat row 63" and rules["<tool>"] == "tool row 64"
    assert rules["<|im_end|>"] in ("mean of chat, tool", "mean of tool, chat") and len(rules) == 3
    assert main(["verify", str(first / "out")]) == 0


@pytest.mark.parametrize("tokens, message", [
    ({"<x>": {"source": "nobody"}}, "output.tokens['<x>'].source: no model 'nobody'"),
    ({"<x>": {"source": "chat"}}, "output.tokens['<x>'].source: model 'chat' has no token '<x>'"),
    ({"<x>": {"source": {"kind": "model_token", "model": "pad", "token": "zz"}}},
     "output.tokens['<x>'].source.token: model 'pad' has no token 'zz'"),
    ({"<x>": {"source": {"kind": "model_token", "model": "pad", "token_id": 64}}},
     "output.tokens['<x>'].source.token_id: 64 is out of range for model 'pad' (64 embedding rows)"),
])
def test_a_bad_token_rule_is_one_line(family, tmp_path, capsys, tokens, message):
    assert main(["run", str(_params(family, tmp_path, tokens=tokens)), "-q"]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err
    assert not (tmp_path / "out").exists()


def test_import_mergekit_maps_union_tokens_and_padding(family, tmp_path, capsys):
    config = {"merge_method": "task_arithmetic", "base_model": str(family / "base"),
              "models": [{"model": str(family / "chat"), "parameters": {"weight": 0.5}}],
              "tokenizer": {"pad_to_multiple_of": 64,
                            "tokens": {"<x>": {"source": str(family / "chat")}, "<y>": {"source": {"kind": "zero"}}}}}
    path = tmp_path / "mk.yml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    assert main(["import-mergekit", str(path), "-o", str(tmp_path / "params.yaml"), "-q"]) == 0
    output = yaml.safe_load((tmp_path / "params.yaml").read_text())["output"]
    assert output["tokenizer_source"] == "union"  # mergekit's tokenizer.source defaults to union
    assert output["pad_to_multiple_of"] == 64
    assert list(output["tokens"]) == ["<x>", "<y>"] and output["tokens"]["<x>"] == {"source": "chat"}
    path.write_text(yaml.safe_dump({**config, "tokenizer_source": "union"}, sort_keys=False))
    assert main(["import-mergekit", str(path), "-o", str(tmp_path / "p2.yaml"), "-q"]) != 0
    assert "tokenizer_source or tokenizer, not both" in capsys.readouterr().err


def test_union_order_is_content_order(family):
    models = {"base": family / "base", "tool": family / "tool", "chat": family / "chat"}
    recipe = Recipe("union", None, {}, None, models)
    a = in_content_order(recipe, {"base": "0", "tool": "2", "chat": "1"})
    assert list(a.models) == ["base", "chat", "tool"]
    assert build(a)[0].tokens[63:] == ["<|im_start|>", "<|im_end|>", "<tool>"]
    b = in_content_order(recipe, {"base": "0", "tool": "1", "chat": "2"})
    assert build(b)[0].tokens[63:] == ["<|im_end|>", "<tool>", "<|im_start|>"]


def test_align_vocabulary_rebuilds_only_where_a_vocabulary_differs(family, tmp_path):
    """output.align_vocabulary (mergekit's tokenizer_source base): a family in the base's
    vocabulary needs no view (the plan is the one without it); `pad` (64 rows for the base's 63
    tokens) is rebuilt in the base's 63."""
    shutil.copytree(family / "base", tmp_path / "twin")

    def recipe(expert: Path):
        params = {"base": str(family / "base"), "method": "task_arithmetic", "parameters": {},
                  "experts": [{"name": "e", "path": str(expert), "weight": 0.5}],
                  "output": {"dir": str(tmp_path / "out"), "align_vocabulary": True}}
        (tmp_path / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
        return config_recipe(load_config(tmp_path / "params.yaml"))
    assert recipe(tmp_path / "twin") is None
    aligned = recipe(family / "pad")
    assert aligned is not None and aligned.source == "base"
    vocab, _ = build(aligned)
    assert vocab.rows == len(vocab.tokens) == 63 and not vocab.is_identity("e", 64)
