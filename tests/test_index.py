import json

import torch
from safetensors.torch import save_file

from mergepipe.methods import requested_ranks
from mergepipe.index.store import Store


def _family_tensors(tmp_path, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    base = {"a": torch.randn(300, 64, generator=g), "b": torch.randn(64, generator=g),
            "c": torch.randn(1000, 33, generator=g), "s": torch.tensor(1.5)}
    base = {k: v.to(dtype) for k, v in base.items()}
    exp = {k: (v.float() + 0.01 * torch.randn(v.shape, generator=g)).to(dtype) for k, v in base.items()}
    exp["c"][:500] = base["c"][:500]  # rows identical to the base
    for name, tensors in (("base", base), ("exp", exp)):
        (tmp_path / name).mkdir()
        save_file(tensors, tmp_path / name / "model.safetensors")
    return base, exp


def test_rank_cuts_are_exact(tmp_path):
    base, exp = _family_tensors(tmp_path)
    st = Store(tmp_path / "cache")
    bc, bi = st.model_index(tmp_path / "base", block_bytes=4096)
    ec, ei = st.model_index(tmp_path / "exp", block_bytes=4096)
    delta = st.delta_index(bc, bi, ec, ei)
    for name in base:
        td = delta.tensors[name]
        a = (exp[name].float() - base[name].float()).abs().reshape(-1)
        n = a.numel()
        assert list(td.ranks) == [0, *requested_ranks(n)]
        assert abs(td.l2 - a.norm().item()) <= 1e-5 * max(1.0, a.norm().item())
        for j, r in enumerate(td.ranks):
            if r == 0:
                continue
            # the r-th largest value, by kthvalue (the (n-r+1)-th smallest)
            assert td.values[j] == torch.kthvalue(a, n - r + 1).values.item(), (name, r)
            assert td.count_gt[j] == int((a > td.values[j]).sum())
            assert td.count_eq[j] == int((a == td.values[j]).sum())
            if j in td.block_eq:
                rows = bi.tensors[name].ranges
                per_block = [int((a.reshape(base[name].shape[0] if base[name].dim() else 1, -1)[r0:r1]
                                  == td.values[j]).sum()) for r0, r1 in rows]
                assert list(td.block_eq[j]) == per_block
    c = delta.tensors["c"]
    assert any(c.identical) and not all(c.identical)
    assert c.block_l2[0] == 0.0 and c.block_l2[-1] > 0


def test_content_hash_is_sharding_independent(tmp_path):
    base, _ = _family_tensors(tmp_path)
    shard = tmp_path / "sharded"
    shard.mkdir()
    save_file({"a": base["a"], "s": base["s"]}, shard / "m1.safetensors")
    save_file({"b": base["b"], "c": base["c"]}, shard / "m2.safetensors")
    wm = {"a": "m1.safetensors", "s": "m1.safetensors", "b": "m2.safetensors", "c": "m2.safetensors"}
    (shard / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    st = Store(tmp_path / "cache")
    _, one = st.model_index(tmp_path / "base", block_bytes=4096)
    _, two = st.model_index(shard, block_bytes=4096)
    assert one.content_hash == two.content_hash
    _, other_block = st.model_index(tmp_path / "base", block_bytes=8192)
    assert other_block.content_hash != one.content_hash


def test_stat_cache_hit_reads_no_data_and_change_reindexes(tmp_path):
    base, exp = _family_tensors(tmp_path)
    st = Store(tmp_path / "cache")
    _, first = st.model_index(tmp_path / "exp", block_bytes=4096)
    assert st.index_reads.total > 0
    again = Store(tmp_path / "cache")
    _, second = again.model_index(tmp_path / "exp", block_bytes=4096)
    assert again.index_reads.total == 0 and again.hits == 1
    assert second == first
    # same path, new content: never the stale index
    exp["a"][0, 0] += 1
    save_file(exp, tmp_path / "exp" / "model.safetensors")
    third_store = Store(tmp_path / "cache")
    _, third = third_store.model_index(tmp_path / "exp", block_bytes=4096)
    assert third_store.builds == 1 and third.content_hash != first.content_hash


def test_index_is_compact(tmp_path):
    _family_tensors(tmp_path)
    st = Store(tmp_path / "cache")
    bc, bi = st.model_index(tmp_path / "base", block_bytes=4096)
    ec, ei = st.model_index(tmp_path / "exp", block_bytes=4096)
    st.delta_index(bc, bi, ec, ei)
    size = sum(p.stat().st_size for p in (tmp_path / "cache").rglob("*.gz"))
    assert size < 0.2 * (bc.total_bytes + ec.total_bytes)


def test_index_threads_do_not_change_results(tmp_path):
    _family_tensors(tmp_path)
    outs = []
    for threads in (1, 2):
        cache = tmp_path / f"cache{threads}"
        st = Store(cache)
        bc, bi = st.model_index(tmp_path / "base", block_bytes=4096, threads=threads)
        ec, ei = st.model_index(tmp_path / "exp", block_bytes=4096, threads=threads)
        outs.append(st.delta_index(bc, bi, ec, ei, threads=threads).to_json())
    assert outs[0] == outs[1]
