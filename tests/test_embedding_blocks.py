"""Row-granular blocks for vocabulary tensors (issue 12, `embedding_block_bytes`).

A family with an embedding and an untied head [vocab, hidden] whose experts change only some
token rows: with `embedding_block_bytes` those tensors get small blocks and every other tensor
keeps its blocks. Checked: the vocabulary rule, budget soundness, determinism (expert order,
threads), full budget = the plain full-read merge byte for byte, a plan that differs from the
plain one only in the vocabulary tensors' blocks, the option's absence leaving plans and
configs as they were, and tampered plans refused."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import save_file

from mergepipe.checkpoint.blocks import BlockLayout, is_vocabulary_tensor
from mergepipe.cli import main
from mergepipe.commands.pipeline import plan_config
from mergepipe.config.params import load_config
from mergepipe.errors import ConfigError
from mergepipe.index.store import Store
from mergepipe.plan.record import check_plan_reads, plan_json, validate_plan

VOCAB, HIDDEN = 512, 32
VOCAB_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")


@pytest.mark.parametrize("name, shape, want", [
    ("model.embed_tokens.weight", (49152, 576), True),
    ("lm_head.weight", (49152, 576), True),
    ("transformer.wte.weight", (50257, 768), True),
    ("bert.embeddings.word_embeddings.weight", (30522, 768), True),
    ("gpt_neox.embed_in.weight", (50304, 512), True),
    ("embed_out.weight", (50304, 512), True),
    ("tok_embeddings.weight", (32000, 4096), True),
    ("transformer.wpe.weight", (1024, 768), False),        # position embeddings
    ("model.embed_tokens.weight", (16, 64), False),        # not [vocab, hidden]
    ("model.embed_tokens.bias", (49152, 576), False),
    ("model.layers.0.mlp.up_proj.weight", (1536, 576), False),
    ("model.embed_tokens.weight", (49152,), False),
    ("my_lm_head.weight", (49152, 576), False),            # a module name, not a substring
])
def test_vocabulary_rule(name, shape, want):
    assert is_vocabulary_tensor(name, shape) is want


def test_layout_plain_when_unset_or_equal():
    assert BlockLayout(1 << 20, 1 << 20) == BlockLayout(1 << 20) == BlockLayout.of(1 << 20)
    assert BlockLayout(1 << 20).key == 1 << 20
    lay = BlockLayout(1 << 20, 64 << 10)
    assert lay.key == "1048576/emb65536"
    assert lay.ranges("lm_head.weight", (49152, 576), 2) == [(r, min(49152, r + 56)) for r in range(0, 49152, 56)]
    assert lay.ranges("model.norm.weight", (576,), 2) == [(0, 576)]
    up = (1536, 576)
    assert lay.ranges("model.layers.0.mlp.up_proj.weight", up, 2) == BlockLayout(1 << 20).ranges("x", up, 2)


@pytest.fixture(scope="module")
def family(tmp_path_factory) -> Path:
    """fp32 base with an embedding and an untied head (64 KiB each), a 64 KiB MLP matrix, a
    norm and a non-vocabulary [16, 64] `wte`-named tensor; three experts that change a few
    scattered token rows of the vocabulary tensors and everything of the other tensors."""
    root = tmp_path_factory.mktemp("embfam")
    g = torch.Generator().manual_seed(0)
    base = {"model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN, generator=g),
            "model.layers.0.mlp.up_proj.weight": torch.randn(256, 64, generator=g),
            "model.layers.0.small.wte.weight": torch.randn(16, 64, generator=g),
            "model.norm.weight": torch.ones(HIDDEN),
            "lm_head.weight": torch.randn(VOCAB, HIDDEN, generator=g)}
    (root / "base").mkdir()
    save_file(base, str(root / "base" / "model.safetensors"), metadata={"format": "pt"})
    for k in range(3):
        ex = {n: t.clone() for n, t in base.items()}
        for name in VOCAB_TENSORS:
            rows = torch.randperm(VOCAB, generator=g)[:24]  # a few tokens per expert
            ex[name][rows] += (0.03 * (k + 1)) * torch.randn(len(rows), HIDDEN, generator=g)
        for name in ("model.layers.0.mlp.up_proj.weight", "model.layers.0.small.wte.weight", "model.norm.weight"):
            ex[name] += 0.01 * torch.randn(ex[name].shape, generator=g)
        (root / f"expert_{k}").mkdir()
        save_file(ex, str(root / f"expert_{k}" / "model.safetensors"), metadata={"format": "pt"})
    return root


def _config(tmp: Path, root: Path, name: str, *, budget: str = "full", emb: str | None = "4KiB",
            order=(0, 1, 2), method: str = "task_arithmetic", params: dict | None = None,
            plan: dict | None = None) -> Path:
    cfg = {"base": str(root / "base"),
           "experts": [{"name": f"e{k}", "path": str(root / f"expert_{k}"), "weight": 1.0} for k in order],
           "method": method, "parameters": params or {"lambda": 1.0}, "budget": budget,
           "block_bytes": "64KiB", "output": {"dir": str(tmp / f"out-{name}")},
           "cache_dir": str(tmp / "cache")}
    if emb is not None:
        cfg["embedding_block_bytes"] = emb
    if plan is not None:
        cfg["plan"] = plan
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def _plan(cfg: Path, tmp: Path, threads: int = 2) -> dict:
    plan, _ = plan_config(load_config(cfg), Store(tmp / "cache"), threads=threads)
    plan = plan_json(plan)
    return plan


def _weights(out: Path) -> bytes:
    return (out / "model.safetensors").read_bytes()


def test_index_differs_only_in_vocabulary_tensors(tmp_path, family):
    store = Store(tmp_path / "cache")
    _, plain = store.model_index(family / "base", block_bytes=64 << 10)
    _, fine = store.model_index(family / "base", block_bytes=BlockLayout(64 << 10, 4 << 10))
    assert fine.embedding_block_bytes == 4 << 10 and plain.embedding_block_bytes is None
    assert fine.content_hash == plain.content_hash  # the model's name does not depend on the layout
    for name, e in plain.tensors.items():
        if name in VOCAB_TENSORS:
            assert len(fine.tensors[name].ranges) == 16 and len(e.ranges) == 1
        else:
            assert fine.tensors[name] == e
    # both cached side by side, each found again
    again = Store(tmp_path / "cache")
    assert again.model_index(family / "base", block_bytes=BlockLayout(64 << 10, 4 << 10))[1] == fine
    assert again.model_index(family / "base", block_bytes=64 << 10)[1] == plain
    assert again.hits == 3 and again.builds == 0  # the layout with vocabulary blocks loads its plain anchor


def test_unset_or_equal_option_changes_nothing(tmp_path, family):
    plain = _plan(_config(tmp_path, family, "plain", budget="40%", emb=None), tmp_path)
    same = _plan(_config(tmp_path, family, "same", budget="40%", emb="64KiB"), tmp_path)
    assert "embedding_block_bytes" not in plain
    assert load_config(_config(tmp_path, family, "same", emb="64KiB")).normalized() == \
        load_config(_config(tmp_path, family, "same", emb=None)).normalized()
    for p in (plain, same):
        p.pop("plan_hash")
    assert plain == same


def test_full_budget_is_the_plain_merge_byte_for_byte(tmp_path, family):
    plain, fine = _config(tmp_path, family, "plain", emb=None), _config(tmp_path, family, "fine")
    assert main(["run", str(plain), "-q"]) == 0
    assert main(["run", str(fine), "-q"]) == 0
    assert _weights(tmp_path / "out-plain") == _weights(tmp_path / "out-fine")
    man = json.loads((tmp_path / "out-fine" / "manifest.json").read_text())
    assert man["plan"]["embedding_block_bytes"] == 4096
    assert main(["verify", str(tmp_path / "out-fine"), "--deep"]) == 0


def test_plan_differs_only_in_vocabulary_blocks(tmp_path, family):
    plain = _plan(_config(tmp_path, family, "plain", emb=None), tmp_path)
    fine = _plan(_config(tmp_path, family, "fine"), tmp_path)
    assert fine["embedding_block_bytes"] == 4096
    for e in fine["experts"]:
        fr, pr = fine["reads"][e["name"]], plain["reads"][e["name"]]
        assert {t: b for t, b in fr.items() if t not in VOCAB_TENSORS} == \
            {t: b for t, b in pr.items() if t not in VOCAB_TENSORS}
        for t in VOCAB_TENSORS:
            assert pr[t] == [0] and 1 <= len(fr[t]) < 16  # only the blocks holding changed rows
    # everything else the same, except the bytes read and what follows from them
    skip = {"reads", "bytes", "budget_bytes", "bound", "plan_hash", "embedding_block_bytes"}
    assert {k: v for k, v in fine.items() if k not in skip} == {k: v for k, v in plain.items() if k not in skip}
    assert fine["bytes"]["planned_expert_bytes"] < plain["bytes"]["planned_expert_bytes"]


@pytest.mark.parametrize("budget", ["5%", "25%", "60%"])
def test_budget_sound_and_verified(tmp_path, family, budget):
    cfg = _config(tmp_path, family, "b", budget=budget, method="ties", params={"lambda": 1.0, "density": 0.5})
    assert main(["run", str(cfg), "-q"]) == 0
    man = json.loads((tmp_path / "out-b" / "manifest.json").read_text())
    assert 0 < man["bytes"]["expert_bytes_read"] <= man["plan"]["budget_bytes"]
    assert man["bytes"]["expert_bytes_read"] == man["plan"]["bytes"]["planned_expert_bytes"]
    assert main(["verify", str(tmp_path / "out-b"), "--deep"]) == 0


def test_deterministic_across_expert_order_and_threads(tmp_path, family):
    a = _config(tmp_path, family, "a", budget="25%")
    b = _config(tmp_path, family, "b", budget="25%", order=(2, 0, 1))
    assert main(["run", str(a), "-q", "--threads", "1"]) == 0
    assert main(["run", str(b), "-q", "--threads", "2"]) == 0
    ma = json.loads((tmp_path / "out-a" / "manifest.json").read_text())
    mb = json.loads((tmp_path / "out-b" / "manifest.json").read_text())
    assert ma["plan_hash"] == mb["plan_hash"] and ma["outputs"] == mb["outputs"]
    assert _weights(tmp_path / "out-a") == _weights(tmp_path / "out-b")


def test_tampered_layout_refused(tmp_path, family, capsys):
    plan = _plan(_config(tmp_path, family, "fine", budget="25%"), tmp_path)
    store = Store(tmp_path / "cache")
    _, base_index = store.model_index(family / "base", block_bytes=64 << 10)
    # the plain-layout base index does not match a plan with vocabulary blocks
    with pytest.raises(ConfigError, match="plan key embedding_block_bytes"):
        check_plan_reads(validate_plan(plan, "p.json"), base_index, {}, None, "p.json")
    bad = dict(plan, embedding_block_bytes=plan["block_bytes"])
    with pytest.raises(ConfigError, match="p.json: plan key embedding_block_bytes: equals block_bytes"):
        validate_plan(bad, "p.json")
    bad = dict(plan, embedding_block_bytes=1000)
    with pytest.raises(ConfigError, match="p.json: plan key embedding_block_bytes"):
        validate_plan(bad, "p.json")
    # the key dropped by hand, hash recomputed: the reads name vocabulary blocks the plain
    # layout does not have, which the checks against the plain-layout indexes refuse
    from mergepipe.plan.planner import plan_hash
    path = tmp_path / "p.json"
    dropped = {k: v for k, v in plan.items() if k not in ("embedding_block_bytes", "plan_hash")}
    dropped["plan_hash"] = plan_hash(dropped)
    path.write_text(json.dumps(dropped))
    capsys.readouterr()
    assert main(["merge", str(path), "-q", "-o", str(tmp_path / "m"), "--cache-dir", str(tmp_path / "cache")]) == 2
    err = capsys.readouterr().err.strip()
    assert "p.json: plan key reads." in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "m").exists()


def test_bad_config_value(tmp_path, family):
    cfg = _config(tmp_path, family, "bad", emb="1KiB")
    with pytest.raises(ConfigError, match="embedding_block_bytes"):
        load_config(cfg)


def test_tampered_cached_index_is_rebuilt(tmp_path, family):
    """A cached index with vocabulary blocks whose other tensors disagree with its plain anchor
    is a miss (rebuilt), never trusted."""
    from mergepipe.index import binfmt
    from mergepipe.index.records import ModelIndex, TensorEntry
    store = Store(tmp_path / "cache")
    lay = BlockLayout(64 << 10, 4 << 10)
    _, fine = store.model_index(family / "base", block_bytes=lay)
    name = "model.norm.weight"
    e = fine.tensors[name]
    forged = ModelIndex(fine.content_hash, fine.block_bytes,
                        {**fine.tensors, name: TensorEntry(name, e.dtype, e.shape, e.ranges, ("0" * 64,))},
                        fine.embedding_block_bytes)
    files = sorted((tmp_path / "cache" / "models").glob("*.idx"))
    target = next(f for f in files if binfmt.decode_model(f.read_bytes()).embedding_block_bytes is not None)
    target.write_bytes(binfmt.encode_model(forged))
    again = Store(tmp_path / "cache")
    assert again.model_index(family / "base", block_bytes=lay)[1] == fine
    assert again.builds == 1


def test_index_file_roundtrip_keeps_the_layout(tmp_path, family):
    from mergepipe.index import binfmt
    store = Store(tmp_path / "cache")
    base, base_index = store.model_index(family / "base", block_bytes=BlockLayout(64 << 10, 4 << 10))
    _, ex, delta = store.expert_index(family / "expert_0", base, base_index)
    assert binfmt.decode_model(binfmt.encode_model(ex)) == ex
    got = binfmt.decode_delta(binfmt.encode_delta(delta))
    assert got.layout == delta.layout == base_index.layout
    plain = store.model_index(family / "base", block_bytes=64 << 10)[1]
    assert b"embedding_block_bytes" not in binfmt.encode_model(plain)
    assert np.isfinite([v for t in delta.tensors.values() for v in t.block_l2]).all()


def test_vocabulary_blocks_rank_as_their_plain_block(tmp_path, family):
    """With vocabulary blocks the energy order ranks a vocabulary block by score / (cost *
    sqrt(16)) (16 = its plain block's rows / its rows: as the plain block with the same delta
    density would rank), every other block by score / cost (then tensor, row_start, expert
    hash). Recomputed here from the delta index, greedy over the budget, it gives the plan's
    reads at every budget; at some budget plain score / cost (which favours the 16x smaller
    vocabulary blocks 4x) would have read something else."""
    from mergepipe.checkpoint.blocks import row_bytes
    from mergepipe.checkpoint.safetensors import ITEMSIZE

    def greedy(cands, budget, scaled):
        def ratio(x):
            return x[0] / (x[1] * (4.0 if scaled and x[2] in VOCAB_TENSORS else 1.0))
        order = sorted(cands, key=lambda x: (-ratio(x), *x[2:5]))
        left, want = budget, {}
        for s, c, tensor, r0, h, name, b in order:
            if c <= left:
                left -= c
                want.setdefault(name, {}).setdefault(tensor, []).append(b)
        return {n: {t: sorted(bs) for t, bs in per.items()} for n, per in want.items()}

    differs = 0
    for budget in ("5%", "15%", "30%", "50%"):
        plan, inputs = plan_config(load_config(_config(tmp_path, family, "r", budget=budget,
                                                       plan={"strategy": "energy"})), Store(tmp_path / "cache"))
        plan = plan_json(plan)
        cands = []
        for e in plan["experts"]:
            idx, delta = inputs.expert_indexes[e["name"]], inputs.deltas[e["name"]]
            for name, entry in idx.tensors.items():
                rb = row_bytes(entry.shape, ITEMSIZE[entry.dtype])
                for b, (r0, r1) in enumerate(entry.ranges):
                    if not delta.tensors[name].identical[b]:
                        cands.append((e["weight"] * delta.tensors[name].block_l2[b], (r1 - r0) * rb, name, r0,
                                      e["content_hash"], e["name"], b))
        got = {n: {t: sorted(bs) for t, bs in per.items()} for n, per in plan["reads"].items() if per}
        assert got == greedy(cands, plan["budget_bytes"], True)
        differs += greedy(cands, plan["budget_bytes"], False) != got
    assert differs
