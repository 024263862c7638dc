"""`mergepipe check`: what a merge would fail on, from headers, config.json and tokenizer files
only, with the error (message and exit code) the merge itself gives; warnings do not fail; a
prediction of reads, writes, disk, memory and time; `run` and `plan` start with the same check,
so a shape mismatch fails before anything is indexed."""
from __future__ import annotations

import json
import math
import mmap
import os
from pathlib import Path

import pytest
import torch
import yaml

from mergepipe.checkpoint.safetensors import open_checkpoint
from mergepipe.cli import main
from mergepipe.commands import check_predict, pipeline
from mergepipe.commands.check import check_file
from mergepipe.index.build import check_compatible
from mergepipe.errors import CheckpointError
from mergepipe.units import format_bytes

H, I, V, L = 64, 128, 256, 2


def _shapes(*, layers: int = L, vocab: int = V, hidden: int = H, inter: int = I) -> dict[str, list[int]]:
    shapes = {"model.embed_tokens.weight": [vocab, hidden], "model.norm.weight": [hidden],
              "lm_head.weight": [vocab, hidden]}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": [hidden, hidden], p + "self_attn.k_proj.weight": [hidden, hidden],
                       p + "mlp.up_proj.weight": [inter, hidden], p + "mlp.down_proj.weight": [hidden, inter],
                       p + "input_layernorm.weight": [hidden]})
    return shapes


def _model(folder: Path, shapes: dict[str, list[int]], *, seed: int = 0, sparse: bool = False,
           tokens: int | None = None, added: int = 0, arch: str = "LlamaForCausalLM") -> Path:
    """A BF16 model folder: model.safetensors (random values, or with `sparse` a valid header over
    a hole: no byte of tensor data was ever written), config.json, tokenizer.json."""
    folder.mkdir(parents=True)
    header, offset = {}, 0
    for name in sorted(shapes):
        n = math.prod(shapes[name]) * 2
        header[name] = {"dtype": "BF16", "shape": shapes[name], "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(folder / "model.safetensors", "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        if sparse:
            f.truncate(8 + len(text) + offset)
        else:
            g = torch.Generator().manual_seed(seed)
            for name in sorted(shapes):
                f.write(torch.randn(math.prod(shapes[name]), generator=g).to(torch.bfloat16).view(torch.int16)
                        .numpy().tobytes())
    vocab = shapes["model.embed_tokens.weight"][0]
    layers = sum(1 for n in shapes if n.endswith("input_layernorm.weight"))
    (folder / "config.json").write_text(json.dumps({"architectures": [arch], "num_hidden_layers": layers,
                                                    "vocab_size": vocab, "hidden_size": H}))
    tokens = vocab if tokens is None else tokens
    (folder / "tokenizer.json").write_text(json.dumps({
        "model": {"type": "BPE", "vocab": {f"t{i}": i for i in range(tokens)}},
        "added_tokens": [{"id": tokens + j, "content": f"<a{j}>"} for j in range(added)]}))
    return folder


def _params(tmp_path: Path, experts: list[str], **overrides) -> Path:
    cfg = {"base": "base", "experts": [{"name": e, "path": e, "weight": 1.0} for e in experts],
           "method": "ties", "parameters": {"lambda": 1.0, "density": 0.5}, "budget": "25%",
           "block_bytes": "4KiB", "output": {"dir": "out"}, "cache_dir": "cache"}
    cfg.update(overrides)
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def _family(tmp_path: Path, expert_shapes: dict[str, list[int]] | None = None, **expert_kw) -> Path:
    """base, a matching expert e0 and an expert e1 (`expert_shapes`, `expert_kw`); its params.yaml."""
    _model(tmp_path / "base", _shapes(), seed=0)
    _model(tmp_path / "e0", _shapes(), seed=1)
    _model(tmp_path / "e1", expert_shapes or _shapes(), seed=2, **expert_kw)
    return _params(tmp_path, ["e0", "e1"])


def _check(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["check", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_a_sound_recipe_passes_with_its_prediction(tmp_path, capsys):
    params = _family(tmp_path)
    rc, out, err = _check(capsys, str(params), "--no-probe")
    assert rc == 0 and err == ""
    assert all(line.startswith(("OK", "  ~")) for line in out.splitlines()), out
    for what in ("read:", "write:", "disk:", "memory:", "time: unknown"):
        assert f"  ~   {what}" in out
    rc, out, _ = _check(capsys, str(params))
    assert rc == 0 and "measured reading" in out and "model.safetensors" in out


def _weight_reads(monkeypatch) -> dict[str, int]:
    """Bytes read from each .safetensors file through os.pread and os.read; mmap refused."""
    counts: dict[str, int] = {}
    real_pread, real_read = os.pread, os.read

    def note(fd: int, n: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        if path.endswith(".safetensors"):
            counts[path] = counts.get(path, 0) + n

    def pread(fd, n, offset):
        data = real_pread(fd, n, offset)
        note(fd, len(data))
        return data

    def read(fd, n):
        data = real_read(fd, n)
        note(fd, len(data))
        return data

    def no_mmap(*a, **k):
        raise AssertionError("check mapped a file")
    monkeypatch.setattr(os, "pread", pread)
    monkeypatch.setattr(os, "read", read)
    monkeypatch.setattr(mmap, "mmap", no_mmap)
    return counts


def _rchar() -> int:
    return int(next(line for line in Path("/proc/self/io").read_text().splitlines()
                    if line.startswith("rchar:")).split()[1])


def test_check_reads_no_tensor_data(tmp_path, monkeypatch):
    """Models whose tensor bytes were never written (a sparse hole after a valid header, 64 MiB
    each): the check reads their headers and, with the probe, PROBE_BYTES of the base, no more;
    by the read calls on the weight files and by the kernel's count of every byte read."""
    big = _shapes(vocab=32768, hidden=512, inter=1024)
    for name, seed in (("base", 0), ("e0", 1), ("e1", 2)):
        _model(tmp_path / name, big, seed=seed, sparse=True)
    params = _params(tmp_path, ["e0", "e1"])
    files = [tmp_path / m / "model.safetensors" for m in ("base", "e0", "e1")]
    headers = {str(f): 8 + int.from_bytes(f.read_bytes()[:8], "little") for f in files}  # before counting
    model_bytes = sum(f.stat().st_size for f in files)
    assert model_bytes > 190 << 20
    small = sum(p.stat().st_size for p in tmp_path.rglob("*.json")) + params.stat().st_size  # config, tokenizer
    assert check_file(params, probe=False).error is None  # every lazy import done before counting
    counts = _weight_reads(monkeypatch)
    before = _rchar()
    report = check_file(params, probe=False)
    read = _rchar() - before
    assert report.error is None, report.text()
    assert counts == headers  # each header once (8 + its length), no byte past it
    assert read < sum(headers.values()) + small + (256 << 10)
    counts.clear()
    before = _rchar()
    report = check_file(params, probe=True)
    read = _rchar() - before
    probe = check_predict.PROBE_BYTES
    assert counts[str(files[0])] == headers[str(files[0])] + probe
    assert {f: n for f, n in counts.items() if f != str(files[0])} == {f: n for f, n in headers.items()
                                                                       if f != str(files[0])}
    assert read < sum(headers.values()) + small + probe + (256 << 10) < model_bytes // 16
    assert "measured reading 8 MiB of model.safetensors" in report.text()


def _merge_error(base: Path, expert: Path) -> str:
    with pytest.raises(CheckpointError) as e:
        check_compatible(open_checkpoint(base), open_checkpoint(expert))
    return str(e.value)


def test_a_shape_mismatch_names_the_tensor_and_both_shapes(tmp_path, capsys):
    shapes = _shapes()
    shapes["model.layers.1.mlp.up_proj.weight"] = [I + 16, H]
    params = _family(tmp_path, shapes)
    rc, out, err = _check(capsys, str(params), "--no-probe")
    assert rc == 3
    assert ("FAIL  expert 'e1' (e1): 1 tensor(s) differ in shape or dtype: 'model.layers.1.mlp.up_proj.weight' "
            f"is BF16[{I + 16}, {H}], the base BF16[{I}, {H}]") in out
    assert "OK    expert 'e0'" in out and "  ~" not in out  # no prediction for a recipe that fails
    assert err == f"mergepipe: error: {_merge_error(tmp_path / 'base', tmp_path / 'e1')}\n"


def test_a_missing_tensor_is_named(tmp_path, capsys):
    shapes = _shapes()
    del shapes["model.norm.weight"]
    rc, out, err = _check(capsys, str(_family(tmp_path, shapes)), "--no-probe")
    assert rc == 3 and "FAIL  expert 'e1' (e1): 1 tensor(s) of the base missing: 'model.norm.weight'" in out
    assert err == f"mergepipe: error: {_merge_error(tmp_path / 'base', tmp_path / 'e1')}\n"


def test_a_vocabulary_difference_is_named_as_such_with_both_sizes(tmp_path, capsys):
    rc, out, err = _check(capsys, str(_family(tmp_path, _shapes(vocab=V + 16))), "--no-probe")
    assert rc == 3
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        assert (f"FAIL  expert 'e1' (e1): vocabulary size {V + 16}, the base {V} ({name!r} has {V + 16} rows, the "
                f"base {V})") in out
    assert f"FAIL  expert 'e1': vocab_size {V + 16}, the base {V} (config.json)" in out
    assert f"FAIL  expert 'e1': tokenizer of {V + 16} tokens, the base's {V}" in out
    assert err.startswith("mergepipe: error: ") and err.count("\n") == 1


def test_a_layer_count_difference_is_named(tmp_path, capsys):
    rc, out, err = _check(capsys, str(_family(tmp_path, _shapes(layers=L + 1))), "--no-probe")
    assert rc == 3
    assert f"FAIL  expert 'e1': {L + 1} layers, the base {L} (config.json)" in out
    assert "FAIL  expert 'e1' (e1): 5 tensor(s) not in the base: 'model.layers.2.input_layernorm.weight'" in out
    assert err == f"mergepipe: error: {_merge_error(tmp_path / 'base', tmp_path / 'e1')}\n"


def test_bad_parameters_fail_as_the_merge_fails(tmp_path, capsys, monkeypatch):
    params = _family(tmp_path)
    cfg = yaml.safe_load(params.read_text())
    cfg["parameters"]["density"] = [{"filter": "self_atn", "value": 0.3}, {"value": 0.5}]  # a typo in a filter
    params.write_text(yaml.safe_dump(cfg))
    rc, out, err = _check(capsys, str(params), "--no-probe")
    assert rc == 2 and "filter 'self_atn' is in no tensor name of the base" in err
    assert [line for line in out.splitlines() if line.startswith("FAIL")] == [f"FAIL  {err.split(': ', 2)[2]}".rstrip()]

    cfg["parameters"] = {"lambda": 1.0, "density": 0.5}
    cfg["method"], cfg["plan"] = "della", {"strategy": "sketch"}  # a strategy the method cannot take
    params.write_text(yaml.safe_dump(cfg))
    rc, out, err = _check(capsys, str(params), "--no-probe")
    assert rc == 2 and "plan: strategy 'sketch' chooses or rescales blocks per expert; method 'della'" in err
    with monkeypatch.context() as m:  # the planner's own refusal, after indexing every model
        m.setattr(pipeline, "preflight", lambda *a, **k: None)
        assert main(["plan", str(params), "-q"]) == 2 and capsys.readouterr().err == err

    cfg["method"], cfg["parameters"] = "ties", {"lambda": "x"}  # refused as params.yaml is read
    del cfg["plan"]
    params.write_text(yaml.safe_dump(cfg))
    rc, out, err = _check(capsys, str(params), "--no-probe")
    assert rc == 2 and out.startswith("FAIL  ") and "parameters.lambda" in err


@pytest.mark.parametrize("budget", ["10B", "0.0000001%"])
def test_a_budget_below_the_floor_fails_as_the_plan_does(tmp_path, capsys, monkeypatch, budget):
    """The same line as the planner's own floor (plan/budget_floor.py), which run gives once the
    check is out of its way and every model is indexed."""
    params = _family(tmp_path)
    rc, out, err = _check(capsys, str(params), "--no-probe", "--budget", budget)
    assert rc == 4 and "is smaller than any expert sketch (20 bytes)" in err
    assert out.splitlines()[-2].startswith("FAIL  budget ")
    monkeypatch.setattr(pipeline, "preflight", lambda *a, **k: None)
    assert main(["run", str(params), "-q", "--budget", budget]) == 4
    assert capsys.readouterr().err == err


def test_added_tokens_whose_embedding_rows_match_only_warn(tmp_path, capsys):
    _model(tmp_path / "base", _shapes(vocab=V + 16), tokens=V)
    _model(tmp_path / "e0", _shapes(vocab=V + 16), tokens=V, added=2, arch="MistralForCausalLM")
    rc, out, err = _check(capsys, str(_params(tmp_path, ["e0"])), "--no-probe")
    assert rc == 0 and err == ""
    assert (f"WARN  expert 'e0': tokenizer of {V + 2} tokens (2 added), the base's {V}; the embedding rows match "
            f"({V + 16}), so they merge row by row; the output gets the base's tokenizer") in out
    assert "WARN  expert 'e0': architectures MistralForCausalLM, the base LlamaForCausalLM (config.json)" in out


def _cache_entries(cache: Path) -> list[Path]:
    return sorted(p for p in cache.rglob("*") if p.is_file()) if cache.exists() else []


@pytest.mark.parametrize("command", ["run", "plan"])
def test_run_and_plan_fail_with_the_checks_line_before_indexing(tmp_path, capsys, command):
    shapes = _shapes()
    shapes["model.layers.0.self_attn.q_proj.weight"] = [H, H + 8]
    params = _family(tmp_path, shapes)
    _, _, check_err = _check(capsys, str(params), "--no-probe")
    assert main([command, str(params), "-q"]) == 3
    assert capsys.readouterr().err == check_err
    assert _cache_entries(tmp_path / "cache") == []  # no index, stat or delta entry: nothing was read
    assert not (tmp_path / "out").exists()


def test_a_mergekit_yaml_is_checked_as_import_mergekit_reads_it(tmp_path, capsys, monkeypatch):
    _family(tmp_path)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mk.yml").write_text(yaml.safe_dump({
        "merge_method": "ties", "base_model": "base", "dtype": "bfloat16",
        "models": [{"model": "e0", "parameters": {"weight": 1.0, "density": 0.5}},
                   {"model": "e1", "parameters": {"weight": 0.5, "density": 0.5}}]}))
    rc, out, err = _check(capsys, "mk.yml", "--no-probe")
    assert rc == 0, err
    assert "recipe mk.yml (converted to mergepipe params): method ties, 2 expert(s)" in out
    assert "OK    output merged-mk: a new folder" in out


def test_an_output_folder_mergepipe_did_not_write_fails_unless_forced(tmp_path, capsys):
    params = _family(tmp_path)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    rc, out, err = _check(capsys, str(params), "--no-probe")
    assert rc == 7 and "refusing to replace it" in err and "FAIL  " in out
    rc, out, err = _check(capsys, str(params), "--no-probe", "--force")
    assert rc == 0 and (tmp_path / "out" / "notes.txt").read_text() == "mine"


def test_the_prediction_bounds_what_the_merge_reads_and_writes(tmp_path, capsys):
    params = _family(tmp_path)
    report = check_file(params, probe=False)
    assert report.error is None
    predicted = {line.split(":")[0].split()[-1]: line for line in report.lines if line.startswith("  ~")}
    assert main(["run", str(params), "-q"]) == 0
    capsys.readouterr()
    man = json.loads((tmp_path / "out" / "manifest.json").read_text())
    written = (tmp_path / "out" / "model.safetensors").stat().st_size
    out_bytes, files = check_predict.output_files(open_checkpoint(tmp_path / "base"), None, None)
    assert files == 1 and written <= out_bytes <= written + 4096  # the data start's alignment, at most
    assert f"write: at most {format_bytes(out_bytes)} in 1 weight file(s)" in predicted["write"]
    b = man["bytes"]
    read = b["expert_bytes_read"] + b.get("sketch_bytes_read", 0)
    full = 2 * sum(math.prod(s) * 2 for s in _shapes().values())
    assert read <= full // 4 and f"at most {format_bytes(full // 4)} of {format_bytes(full)} expert bytes" \
        in predicted["read"]
    cache = sum(p.stat().st_size for p in _cache_entries(tmp_path / "cache") if "merges" not in p.parts)
    assert f"the output {format_bytes(out_bytes)}, the cache" in predicted["disk"] and cache > 0
