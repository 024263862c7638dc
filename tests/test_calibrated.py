"""The `calibrated` plan strategy: importance from the base on calibration text.

A tiny Llama (random init, a word-level tokenizer) stands in for a real decoder: the
calibration pass runs transformers on it, so this checks the whole path (text ->
factored Fisher artifact -> weighted block energies -> plan -> merge) and its contracts:
budget-sound, deterministic, cached by content, full budget = the plain merge, untrusted
artifacts and cache entries refused, one-line errors."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from blake3 import blake3

from mergepipe.calibrate import artifact
from mergepipe.checkpoint.safetensors import open_checkpoint
from mergepipe.plan.strategies import STRATEGIES, Candidate, PlanContext
from mergepipe.plan.strategies.calibrated import CalibratedParams
from tests.helpers.tiny_llama import calibrated_config as _config
from tests.helpers import calibrated_plan

def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "mergepipe", *args], capture_output=True, text=True)
    if check:
        assert r.returncode == 0, r.stderr
    return r


def _plan(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())["plan"]


def test_calibrated_budget_plan_records_its_importance(llama, tmp_path):
    r = _run("run", str(_config(tmp_path, llama, "30%")))
    plan = _plan(tmp_path / "out-30")
    assert plan["bytes"]["planned_expert_bytes"] <= plan["budget_bytes"]
    assert 0 < plan["bytes"]["planned_expert_bytes"] < plan["bytes"]["full_read_expert_bytes"]
    cal = plan["strategy"]["calibration"]
    assert len(cal["artifact"]) == 64 and len(cal["text"]) == 64
    # the text uses 8 of the 17 tokens: their rows of the tied embedding carry its importance
    arts = list((llama / "cache" / "calibration").glob("*.safetensors"))
    assert len(arts) == 1
    imp = artifact.load(arts[0], open_checkpoint(llama / "base"))
    rows, _ = imp["model.embed_tokens.weight"]
    used = [i + 1 for i in range(8)]
    assert rows[used].min() > 3 * rows[[0, *range(9, 17)]].max()
    # a second run is a no-op; a new budget reuses the artifact and the energies (no new file)
    _run("run", str(_config(tmp_path, llama, "30%")))
    _run("run", str(_config(tmp_path, llama, "60%")))
    assert list((llama / "cache" / "calibration").glob("*.safetensors")) == arts
    assert len(list((llama / "cache" / "weighted").glob("*.json"))) == 2
    # explain says what the budget keeps of the importance, before a merge (params.yaml)
    # and after (the output folder)
    for target in (str(_config(tmp_path, llama, "30%")), str(tmp_path / "out-30")):
        r = _run("explain", target, "--cache-dir", str(llama / "cache"))
        line = next(x for x in r.stdout.splitlines() if x.startswith("importance kept"))
        assert 30 < float(line.rsplit(" ", 1)[1].rstrip("%")) <= 100


def test_calibrated_full_budget_is_the_plain_merge(llama, tmp_path):
    _run("run", str(_config(tmp_path, llama, "100%")))
    cfg = yaml.safe_load(_config(tmp_path, llama, "100%").read_text())
    cfg.pop("plan")
    cfg["output"]["dir"] = str(tmp_path / "plain")
    p = tmp_path / "plain.yaml"
    p.write_text(yaml.safe_dump(cfg))
    _run("run", str(p))
    a = (tmp_path / "out-100" / "model.safetensors").read_bytes()
    assert a == (tmp_path / "plain" / "model.safetensors").read_bytes()


def test_select_is_budget_sound_deterministic_and_complete():
    rng = np.random.default_rng(3)
    cands, scores = [], {}
    for i in range(60):
        expert = "ab"[i % 2]
        cost = int(rng.integers(100, 400))
        cands.append(Candidate(-float(rng.random()), f"t{i // 6}", i, f"{expert}hash", expert, i, cost, 1.0, 1.0))
        if i % 7:  # some tensors uncovered
            scores[(expert, f"t{i // 6}", i)] = float(rng.random())
    cands.sort(key=lambda c: c[:4])
    ctx = PlanContext((("a", "ahash"), ("b", "bhash")), {"a": 1.0, "b": 0.5}, scores)
    s = STRATEGIES["calibrated"]
    total = sum(c.cost for c in cands)
    for shares in ("none", "weight", "equal"):
        p = CalibratedParams(text="x", shares=shares)
        for budget in (0, 500, 3000, total // 2):
            chosen = s.select(cands, budget, ctx, p).chosen
            assert sum(c.cost for c, t in zip(cands, chosen) if t) <= budget
            assert chosen == s.select(cands, budget, ctx, p).chosen
        assert all(s.select(cands, total, ctx, p).chosen)
    # the highest calibrated score per byte is taken first, whatever its energy order
    best = max(scores, key=lambda k: (0.5 if k[0] == "b" else 1.0) * scores[k] ** 0.5
               / next(c.cost for c in cands if (c.expert, c.tensor, c.block) == k))
    first = s.select(cands, max(c.cost for c in cands), ctx, CalibratedParams(text="x")).chosen
    assert any(t and (c.expert, c.tensor, c.block) == best for c, t in zip(cands, first))


def test_vocabulary_share_caps_the_first_pass():
    """vocabulary_share: the vocabulary tensors get at most that share of the budget while
    other candidates remain; leftovers go to anyone; budget-sound; full budget reads all; unset,
    the options' normalized form (hence old plans' hashes) is unchanged."""
    from mergepipe.plan.strategies import normalized_options
    rng = np.random.default_rng(5)
    cands, scores = [], {}
    for i in range(80):
        expert = "ab"[i % 2]
        tensor = "model.embed_tokens.weight" if i < 40 else f"t{i // 8}"
        cost = 64 if i < 40 else 1024
        cands.append(Candidate(-float(rng.random()), tensor, i, f"{expert}hash", expert, i, cost, 1.0, 1.0))
        scores[(expert, tensor, i)] = float(rng.random()) * (1e4 if i < 40 else 1.0)  # vocab rows first
    cands.sort(key=lambda c: c[:4])
    ctx = PlanContext((("a", "ahash"), ("b", "bhash")), {"a": 1.0, "b": 1.0}, scores,
                      vocabulary=frozenset({"model.embed_tokens.weight"}))
    s = STRATEGIES["calibrated"]
    total = sum(c.cost for c in cands)

    def vocab_bytes(chosen):
        return sum(c.cost for c, t in zip(cands, chosen) if t and c.tensor in ctx.vocabulary)

    uncapped = s.select(cands, 4000, ctx, CalibratedParams(text="x")).chosen
    assert vocab_bytes(uncapped) == 40 * 64  # every vocabulary row first
    for share in (0.1, 0.3):
        p = CalibratedParams(text="x", vocabulary_share=share)
        for budget in (0, 1000, 4096, 20480):
            chosen = s.select(cands, budget, ctx, p).chosen
            assert sum(c.cost for c, t in zip(cands, chosen) if t) <= budget
            # other candidates remain (40 x 1024 bytes): only the cap and leftovers smaller
            # than a non-vocabulary block go to vocabulary rows
            assert vocab_bytes(chosen) <= share * budget + 1023
            if 1024 <= budget and share * budget + 1023 < 40 * 64:  # the cap binds: fewer rows than uncapped
                uncapped = s.select(cands, budget, ctx, CalibratedParams(text="x")).chosen
                assert vocab_bytes(chosen) < vocab_bytes(uncapped)
        assert all(s.select(cands, total, ctx, p).chosen)
    # leftovers: with room for every non-vocabulary block, the rest goes to vocabulary rows
    assert vocab_bytes(s.select(cands, 40 * 1024 + 1000, ctx, CalibratedParams(text="x", vocabulary_share=0.01)
                                ).chosen) == 1000 // 64 * 64
    assert "vocabulary_share" not in normalized_options({"strategy": "calibrated", "text": "x"})
    with pytest.raises(Exception, match="vocabulary_share needs shares: none"):
        CalibratedParams(text="x", vocabulary_share=0.2, shares="weight")


def test_bad_text_is_a_one_line_error_and_a_tampered_artifact_is_rebuilt(llama, tmp_path):
    r = _run("run", str(_config(tmp_path, llama, "30%", text="missing.txt")), check=False)
    assert r.returncode != 0 and "missing.txt: calibration text not found" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    _run("run", str(_config(tmp_path, llama, "40%")))
    art = next((llama / "cache" / "calibration").glob("*.safetensors"))
    saved = art.read_bytes()
    try:
        data = bytearray(saved)
        data[-4:] = np.array([-1.0], dtype="<f4").tobytes()  # a negative importance
        art.write_bytes(bytes(data))
        (tmp_path / "out-40").rename(tmp_path / "old")  # force a re-plan
        _run("run", str(_config(tmp_path, llama, "40%")))  # the store is untrusted: rebuilt (design.md)
        assert art.read_bytes() != bytes(data)
        man = json.loads((tmp_path / "out-40" / "manifest.json").read_text())
        assert man["plan"]["strategy"]["calibration"]["artifact"] == blake3(art.read_bytes()).hexdigest()
    finally:
        art.write_bytes(saved)


def _warn_on_load(monkeypatch):
    """transformers warning while loading the base (as it does for unused config keys, a
    deprecated argument...): through its logger and through the warnings module."""
    import warnings
    import transformers
    from transformers.utils import logging as hf_logging
    original = transformers.AutoTokenizer.from_pretrained

    def noisy(*args, **kwargs):
        hf_logging.get_logger("transformers.test").warning("a transformers warning")
        warnings.warn("a library warning", FutureWarning)
        return original(*args, **kwargs)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", noisy)


_NOISE = {
    "text_longer_than_the_context": lambda monkeypatch: None,  # 9000 chars > the tiny tokenizer's 2048
    "library_warning_while_loading": _warn_on_load,
}


@pytest.mark.parametrize("noise", sorted(_NOISE))
def test_calibration_under_q_prints_nothing(noise, tiny_family, tmp_path, capfd, monkeypatch):
    """`mergepipe plan -q` of a calibrated config printed transformers' "Token indices sequence
    length is longer than the specified maximum" (the text is cut into seq_len sequences on
    purpose) and whatever else it logs while loading. -q is quiet now; transformers' own
    verbosity is left as it was."""
    from transformers.utils import logging as hf_logging
    _NOISE[noise](monkeypatch)
    level = hf_logging.get_verbosity()
    capfd.readouterr()
    calibrated_plan(tiny_family, tmp_path, tmp_path / "cache", "the quick brown fox jumps. " * 340)
    assert capfd.readouterr().err == ""
    assert hf_logging.get_verbosity() == level


def test_a_corpus_sized_calibration_text_is_read_only_as_far_as_max_tokens_needs(tiny_family, tmp_path, monkeypatch):
    """`plan.text` pointing at a whole corpus (an ordinary slip: the training set, not a sample):
    the calibration pass read and tokenized all of it to keep `max_tokens` tokens (a 30 MB
    text took 108 s and 13 GB for 64 tokens; a GB-sized one is killed for memory). Now only
    a prefix that holds `max_tokens` tokens and a margin is tokenized, with the same tokens
    (so the same importance), while the text's hash still covers every byte."""
    import transformers
    seen: list[int] = []
    original = transformers.AutoTokenizer.from_pretrained

    def recording(*args, **kwargs):
        tok = original(*args, **kwargs)
        call = type(tok).__call__
        monkeypatch.setattr(type(tok), "__call__", lambda self, text, *a, **k: (seen.append(len(text)),
                                                                                  call(self, text, *a, **k))[1])
        return tok
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", recording)
    line = "the quick brown fox jumps over the lazy dog; 0123456789\n"
    big = line * (5_000_000 // len(line))
    plans = {}
    for name, text in (("big", big), ("small", big[:5000])):
        plan_path = calibrated_plan(tiny_family, tmp_path / name, tmp_path / f"c-{name}", text)
        plans[name] = json.loads(plan_path.read_text())
    assert max(seen) < 1_000_000, seen
    assert plans["big"]["reads"] == plans["small"]["reads"]
    from blake3 import blake3
    assert plans["big"]["strategy"]["calibration"]["text"] == blake3(big.encode()).hexdigest()
