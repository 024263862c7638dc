"""The demo family generator: determinism, layout, fine-tune structure, HF loadability.

Reads files with safetensors' own `safe_open`, never with mergepipe's reader, so the
fixtures other tests build on are checked independently of the code they test.
"""
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from mergepipe.commands.demo import NEW_TOKENS, PRESETS, main, make_family


def load(folder: str | Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            tensors |= {name: f.get_tensor(name) for name in f.keys()}
    return tensors


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(folder.iterdir())}


@pytest.fixture(scope="session")
def family(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return make_family(tmp_path_factory.mktemp("demo") / "tiny")


def test_same_arguments_give_identical_bytes(family: dict, tmp_path: Path) -> None:
    again = make_family(tmp_path / "again")
    assert {k: v for k, v in again.items() if k not in ("base", "experts")} == \
        {k: v for k, v in family.items() if k not in ("base", "experts")}
    for first, second in zip([family["base"], *family["experts"]],
                             [again["base"], *again["experts"]], strict=True):
        assert folder_bytes(Path(first)) == folder_bytes(Path(second))


def test_seed_changes_weights(family: dict, tmp_path: Path) -> None:
    other = make_family(tmp_path / "other", n_experts=1, seed=1)
    first = load(family["base"])["model.layers.0.mlp.up_proj.weight"]
    assert not torch.equal(first, load(other["base"])["model.layers.0.mlp.up_proj.weight"])


def test_llama_layout_and_config(family: dict) -> None:
    p = PRESETS["tiny"]
    base = load(family["base"])
    assert base["model.embed_tokens.weight"].shape == (p.vocab, p.hidden)
    assert base["model.layers.0.self_attn.k_proj.weight"].shape == (
        p.kv_heads * p.hidden // p.heads, p.hidden)
    assert base["model.layers.3.mlp.down_proj.weight"].shape == (p.hidden, p.intermediate)
    assert len(base) == 9 * p.layers + 3  # 9 per layer + embed, final norm, lm_head
    config = json.loads((Path(family["base"]) / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert config["torch_dtype"] == "bfloat16" and config["tie_word_embeddings"] is False
    assert (Path(family["base"]) / "generation_config.json").exists()


def test_experts_match_base_names_shapes_dtypes(family: dict) -> None:
    base = load(family["base"])
    assert {t.dtype for t in base.values()} == {torch.bfloat16}
    for expert in family["experts"]:
        tensors = load(expert)
        assert tensors.keys() == base.keys()
        for name, tensor in tensors.items():
            assert (tensor.shape, tensor.dtype) == (base[name].shape, base[name].dtype), name


def test_fine_tune_structure(family: dict) -> None:
    base = load(family["base"])
    n_changed = 0
    for expert in family["experts"]:
        model, tensors = Path(expert).name, load(expert)
        identical = [n for n in base if torch.equal(tensors[n], base[n])]
        assert sorted(identical) == sorted(family["identical"][model])
        assert 0 < len(identical) < len(base)
        assert "model.layers.0.input_layernorm.weight" in identical  # most norms untouched
        n_changed += len(base) - len(identical)
        for name, (start, stop) in family["changed_rows"][model].items():
            same_rows = torch.equal(tensors[name][:start], base[name][:start])
            assert same_rows and not torch.equal(tensors[name][start:stop], base[name][start:stop])
    assert n_changed > len(base) * len(family["experts"]) / 2  # most tensors move
    assert "model.embed_tokens.weight" in family["identical"]["expert_1"]  # frozen embeddings
    assert "model.layers.0.self_attn.q_proj.weight" in family["identical"]["expert_1"]
    rows = family["changed_rows"]["expert_2"]["model.embed_tokens.weight"]
    assert rows == [PRESETS["tiny"].vocab - NEW_TOKENS, PRESETS["tiny"].vocab]


def test_deltas_differ_in_size_across_layers_and_experts(family: dict) -> None:
    base = load(family["base"])
    name = "model.layers.{}.mlp.up_proj.weight"

    def delta_norm(expert: str, layer: int) -> float:
        return (load(expert)[name.format(layer)].float() - base[name.format(layer)].float()).norm()

    first, last = family["experts"][0], family["experts"][2]
    assert delta_norm(first, 3) > 1.5 * delta_norm(first, 0)
    assert delta_norm(last, 3) > 1.5 * delta_norm(first, 3)


def test_sharded_expert_index_is_consistent(family: dict) -> None:
    folder = Path(family["experts"][0])
    assert family["sharded"] == "expert_0" and not (folder / "model.safetensors").exists()
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    files = sorted(folder.glob("model-*-of-*.safetensors"))
    assert len(files) >= 3 and set(index["weight_map"].values()) == {f.name for f in files}
    total = 0
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                assert index["weight_map"][name] == file.name
                tensor = f.get_tensor(name)
                total += tensor.numel() * tensor.element_size()
    assert index["metadata"]["total_size"] == total
    assert index["weight_map"].keys() == load(family["base"]).keys()


def test_tied_drops_lm_head_and_base_can_be_sharded(tmp_path: Path) -> None:
    tied = make_family(tmp_path, n_experts=1, tied=True, dtype="float32", shard_expert=-1)
    for folder in [tied["base"], *tied["experts"]]:
        tensors = load(folder)
        assert "lm_head.weight" not in tensors and "model.embed_tokens.weight" in tensors
        assert {t.dtype for t in tensors.values()} == {torch.float32}
        assert json.loads((Path(folder) / "config.json").read_text())["tie_word_embeddings"]
    assert tied["sharded"] == "base" and (Path(tied["experts"][0]) / "model.safetensors").exists()
    assert (Path(tied["base"]) / "model.safetensors.index.json").exists()


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path / "cli"), "--experts", "2", "--dtype", "float16", "--quiet"]) == 0
    assert load(tmp_path / "cli" / "expert_1")["model.norm.weight"].dtype == torch.float16
    assert not (tmp_path / "cli" / "expert_2").exists()
    assert main([str(tmp_path / "bad"), "--experts", "0"]) == 2
    assert "n_experts" in capsys.readouterr().err


def test_transformers_loads_and_runs(family: dict, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(family["base"])
    ids = tokenizer("merge me")["input_ids"]
    assert tokenizer.decode(ids) == "merge me"
    for folder in [family["base"], family["experts"][0]]:  # one file, then shards
        model = transformers.AutoModelForCausalLM.from_pretrained(folder)
        logits = model(torch.tensor([ids])).logits
        assert logits.shape == (1, len(ids), PRESETS["tiny"].vocab)
        assert logits.float().isfinite().all()
    tied = make_family(tmp_path, n_experts=1, tied=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(tied["base"])
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


def test_demo_never_overwrites_a_users_model_folder(tmp_path):
    """`mergepipe demo models` where models/base is the user's own model: refused, weights kept;
    a folder demo wrote before is rewritten as always."""
    from mergepipe.commands.demo import main as demo_main
    real = tmp_path / "models" / "base"
    real.mkdir(parents=True)
    (real / "model.safetensors").write_bytes(b"the user's weights")
    assert demo_main([str(tmp_path / "models"), "--quiet", "--experts", "1"]) == 7
    assert (real / "model.safetensors").read_bytes() == b"the user's weights"
    assert demo_main([str(tmp_path / "demo"), "--quiet", "--experts", "1"]) == 0
    assert demo_main([str(tmp_path / "demo"), "--quiet", "--experts", "1"]) == 0  # a rerun rewrites its own


def test_a_demo_rerun_keeps_a_users_model_in_the_demo_folder(tmp_path):
    """Once a folder held demo's marker, a rerun rewrote base/ and expert_*/ whatever they held:
    a user's model put at expert_2/ (then `demo --experts 3`) or a fine-tune saved over
    expert_0/'s weights was replaced. The marker now records the blake3 of every file demo
    wrote; a file of demo's names with other bytes is refused, kept."""
    from mergepipe.commands.demo import make_family
    from mergepipe.errors import OutputError
    import pytest
    out = tmp_path / "demo"
    make_family(out, preset="tiny", n_experts=2, shard_expert=None)
    make_family(out, preset="tiny", n_experts=2, shard_expert=None)  # its own files: rewritten
    (out / "expert_2").mkdir()
    (out / "expert_2" / "model.safetensors").write_bytes(b"a user's model")
    with pytest.raises(OutputError, match="expert_2/model.safetensors"):
        make_family(out, preset="tiny", n_experts=3, shard_expert=None)
    assert (out / "expert_2" / "model.safetensors").read_bytes() == b"a user's model"
    (out / "expert_2" / "model.safetensors").unlink()
    (out / "expert_0" / "model.safetensors").write_bytes(b"a fine-tune")
    with pytest.raises(OutputError, match="expert_0/model.safetensors"):
        make_family(out, preset="tiny", n_experts=3, shard_expert=None, seed=1)
    assert (out / "expert_0" / "model.safetensors").read_bytes() == b"a fine-tune"
