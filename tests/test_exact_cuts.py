"""Exact rank cuts off the index's grid (index/extra_cuts.py, commands/cuts.py): what a TIES or
Breadcrumbs density or gamma between two-decimal values asks for. The cuts are the full
tensor's (value, counts above and equal, per-block counts where a run of equal values is split),
the merge equals the full-read definition (the method on whole tensors, cuts from a sort), the
cuts and the output are the same bytes at any thread count, a hostile cache entry is refused in
one line, a plan from disk is merged with the cuts it records (a forged record is refused), and
gc keeps the entries a --keep plan names."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
import yaml

from mergepipe.cli import main
from mergepipe.commands.gc import collect, keep_of
from mergepipe.index import extra_cuts
from mergepipe.index.build import build_extra_cuts
from mergepipe.index.ranks import requested_ranks
from mergepipe.index.store import Store
from mergepipe.plan.record import plan_hash
from tests.helpers import load_model, one_line_error, write_config
from tests.helpers.cuts import run_method

# off the grid: per expert, per tensor (a gradient over the layers), and a gamma
CONFIGS = {
    "ties": ({"density": 0.333}, [{"density": 0.125}, {}, {"density": [0.125, 0.333]}]),
    "breadcrumbs": ({"density": 0.333, "gamma": 0.017}, [{"density": 0.125}, {"gamma": 0.0125}, {}]),
    "breadcrumbs_ties": ({"density": [0.4567, 0.125], "gamma": 0.013}, [{}, {"density": 0.333}, {}]),
}


def _config(tmp_path, family, method: str, **extra):
    params, experts = CONFIGS[method]
    path = write_config(tmp_path, family, method=method, parameters=params, **extra)
    cfg = yaml.safe_load(path.read_text())
    for e, own in zip(cfg["experts"], experts):
        e.update(own)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def _manifest(out) -> dict:
    return json.loads((out / "manifest.json").read_text())


def test_extra_cuts_are_the_full_tensors_cuts(tmp_path, tiny_family):
    """At any ranks, each cut is the full tensor's: the |delta| at that rank, how many elements
    are above and equal, and per block the equal ones where the rank splits their run; at
    grid ranks, exactly what the delta index stores."""
    store = Store(tmp_path / "cache")
    root = tiny_family["root"]
    base, base_index = store.model_index(root / "base", block_bytes=16 << 10)
    expert, index, delta = store.expert_index(root / "expert_1", base, base_index)
    chosen = [n for n in base.tensors if base.tensors[n].dtype == "BF16" and base.tensors[n].numel > 1]
    wanted = {}
    for name in chosen:
        n = base.tensors[name].numel
        wanted[name] = tuple(sorted({max(1, int(p * n)) for p in (0.0001, 0.125, 0.333, 0.4567, 0.999)}
                                    | {requested_ranks(n)[len(requested_ranks(n)) // 2]}))
    got = build_extra_cuts(base, expert, base_index, index, wanted, threads=2)
    base_t, exp_t = load_model(root / "base"), load_model(root / "expert_1")
    splits = 0
    for name, ranks in wanted.items():
        magnitudes = (exp_t[name].float() - base_t[name].float()).abs().reshape(-1)
        per_row = magnitudes.numel() // base.tensors[name].shape[0]
        td, stored = got[name], delta.tensors[name]
        assert td.ranks == (0, *ranks)
        for j, rank in enumerate(ranks, 1):
            value = torch.sort(magnitudes, descending=True).values[rank - 1]
            assert td.values[j] == float(value)
            above, equal = int((magnitudes > value).sum()), int((magnitudes == value).sum())
            assert (td.count_gt[j], td.count_eq[j]) == (above, equal)
            if td.count_gt[j] < rank < td.count_gt[j] + td.count_eq[j]:
                splits += 1
                blocks = [int((magnitudes[a * per_row:b * per_row] == value).sum())
                          for a, b in index.tensors[name].ranges]
                assert td.block_eq[j] == tuple(blocks)
            else:
                assert j not in td.block_eq
            if rank in stored.ranks:  # a grid rank: the index's own cut
                k = stored.ranks.index(rank)
                assert (stored.values[k], stored.count_gt[k], stored.count_eq[k]) == \
                    (td.values[j], td.count_gt[j], td.count_eq[j])
    assert splits > 0  # bf16 deltas repeat: some cut splits a run of equal values


@pytest.mark.parametrize("method", sorted(CONFIGS))
def test_an_off_grid_merge_is_the_full_read_definition(tmp_path, tiny_family, method):
    """`mergepipe run` at these densities writes, tensor by tensor, the method's result on the
    whole tensors with cuts from a full sort (tests/helpers/cuts.py), cast to bf16: the same bytes."""
    assert main(["run", str(_config(tmp_path, tiny_family, method)), "-q"]) == 0
    plan = _manifest(tmp_path / "out")["plan"]
    assert sorted(plan["cuts"]) == ["e0", "e1", "e2"]
    ours = load_model(tmp_path / "out")
    root = tiny_family["root"]
    base = load_model(root / "base")
    experts = [load_model(root / f"expert_{k}") for k in range(3)]
    from mergepipe.plan.tensor_params import group_index, view
    checked = 0
    for name, b in base.items():
        if not b.is_floating_point():
            continue
        params, entries = view(plan, group_index(plan, name))
        by_name = {e["name"]: e for e in entries}
        inputs = []
        for k, tensors in enumerate(experts):
            e = by_name[f"e{k}"]
            inputs.append({"name": e["name"], "hash": e["content_hash"], "weight": e["weight"],
                           "delta": tensors[name].float() - b.float(),
                           **{knob: e.get(knob, params.get(knob)) for knob in ("density", "gamma")
                              if e.get(knob, params.get(knob)) is not None}})
        want = run_method(method, params, b.float(), inputs, tensor=name).to(b.dtype)
        assert torch.equal(ours[name].view(torch.int16), want.view(torch.int16)), name
        checked += 1
    assert checked > 10


def test_cuts_and_output_are_the_same_bytes_at_any_thread_count(tmp_path, tiny_family):
    outs = []
    for threads in (1, 2, 3):
        d = tmp_path / f"t{threads}"
        d.mkdir()
        assert main(["run", str(_config(d, tiny_family, "breadcrumbs")), "-q", "--threads", str(threads)]) == 0
        cuts = {p.name: p.read_bytes() for p in sorted((d / "cache" / "cuts").iterdir())}
        outs.append((_manifest(d / "out")["manifest_hash"], (d / "out" / "model.safetensors").read_bytes(), cuts))
    assert outs[0] == outs[1] == outs[2]


def _hostile(entry: dict) -> dict:
    """A self-consistent entry (its blake3 recomputed) whose first cut claims another value."""
    name = sorted(entry["tensors"])[0]
    entry["tensors"][name][0][1] += 1 << 20
    tensors = {n: tuple(extra_cuts.Cut(r, v, gt, eq, None if be is None else tuple(be)) for r, v, gt, eq, be in rows)
               for n, rows in entry["tensors"].items()}
    entry["blake3"] = extra_cuts._digest(extra_cuts._cuts_json(tensors))
    return entry


@pytest.mark.parametrize("damage", ["truncated", "edited", "hostile", "foreign key"])
def test_a_damaged_or_hostile_cache_entry_is_refused_in_one_line(tmp_path, tiny_family, capsys, damage):
    path = _config(tmp_path, tiny_family, "ties")
    assert main(["run", str(path), "-q"]) == 0
    entries = sorted((tmp_path / "cache" / "cuts").iterdir())
    victim = entries[0]
    data = json.loads(victim.read_bytes())
    if damage == "truncated":
        victim.write_bytes(victim.read_bytes()[:100])
    elif damage == "edited":
        name = sorted(data["tensors"])[0]
        data["tensors"][name][0][1] ^= 1  # the value's last bit, blake3 left as it was
        victim.write_bytes(json.dumps(data).encode())
    elif damage == "hostile":
        victim.write_bytes(json.dumps(_hostile(data)).encode())
    else:  # another expert's entry under this one's name
        other = json.loads(entries[1].read_bytes())
        victim.write_bytes(json.dumps({**other, "key": data["key"]}).encode())
    shutil.rmtree(tmp_path / "out")  # else run's no-op check returns before planning
    capsys.readouterr()
    assert main(["run", str(path), "-q"]) == 6
    err = one_line_error(capsys, str(victim), "delete it")
    assert damage != "hostile" or "contradicts the delta index" in err
    assert not (tmp_path / "out").exists()


def test_a_plan_is_merged_with_the_cuts_it_records(tmp_path, tiny_family, capsys):
    """A plan from disk with its cuts recorded merges to run's bytes in a fresh cache (the cuts
    made again); one whose record names other cuts (hash recomputed) is refused, nothing written."""
    path = _config(tmp_path, tiny_family, "ties")
    assert main(["run", str(path), "-q"]) == 0
    assert main(["plan", str(path), "-q", "-o", str(tmp_path / "plan.json")]) == 0
    assert main(["merge", str(tmp_path / "plan.json"), "-q", "-o", str(tmp_path / "again"),
                 "--cache-dir", str(tmp_path / "fresh")]) == 0
    weights = "model.safetensors"
    assert (tmp_path / "again" / weights).read_bytes() == (tmp_path / "out" / weights).read_bytes()
    plan = json.loads((tmp_path / "plan.json").read_text())
    plan["cuts"]["e1"] = "0" * 64
    plan["plan_hash"] = plan_hash({k: v for k, v in plan.items() if k != "plan_hash"})
    (tmp_path / "forged.json").write_text(json.dumps(plan))
    capsys.readouterr()
    assert main(["merge", str(tmp_path / "forged.json"), "-q", "-o", str(tmp_path / "forged"),
                 "--cache-dir", str(tmp_path / "fresh")]) == 6
    one_line_error(capsys, "plan key cuts.e1", "plan again")
    assert not (tmp_path / "forged").exists()


def test_gc_keeps_the_cuts_a_kept_output_names(tmp_path, tiny_family):
    path = _config(tmp_path, tiny_family, "ties")
    assert main(["run", str(path), "-q"]) == 0
    cuts = sorted((tmp_path / "cache" / "cuts").iterdir())
    assert len(cuts) == 3
    (tmp_path / "cache" / "cuts" / f"{'a' * 40}.cuts").write_bytes(b"a user's file")  # not ours: kept
    removed = {r.path for r in collect(tmp_path / "cache", keep_of([str(tmp_path / "out")]))}
    assert not removed & set(cuts)
    assert set(cuts) <= {r.path for r in collect(tmp_path / "cache", set())}
    assert tmp_path / "cache" / "cuts" / f"{'a' * 40}.cuts" not in {r.path for r in collect(tmp_path / "cache", set())}


def test_the_plan_records_cuts_only_off_the_grid(tmp_path, tiny_family):
    """Densities that land on stored ranks need no cuts; the recorded ones are sorted by expert."""
    assert main(["run", str(write_config(tmp_path, tiny_family, method="ties", parameters={"density": 0.33})),
                 "-q"]) == 0
    assert "cuts" not in _manifest(tmp_path / "out")["plan"]


def test_a_budgeted_off_grid_merge_replays(tmp_path, tiny_family):
    """Under a budget (the default sketch strategy for ties) the read blocks are trimmed with the
    exact cuts, and `verify --inputs --replay` rebuilds the same output from the plan."""
    path = _config(tmp_path, tiny_family, "ties", budget="25%")
    assert main(["run", str(path), "-q"]) == 0
    plan = _manifest(tmp_path / "out")["plan"]
    assert plan["cuts"] and plan["bytes"]["planned_expert_bytes"] < plan["bytes"]["full_read_expert_bytes"]
    assert main(["verify", str(tmp_path / "out"), "-q", "--inputs", "--replay"]) == 0


def test_check_predicts_the_scan_off_the_grid_only(tmp_path, tiny_family, capsys):
    """`mergepipe check` counts the extra scan's reads for a density off the grid, not on it."""
    (tmp_path / "off").mkdir()
    off = _config(tmp_path / "off", tiny_family, "ties")
    (tmp_path / "on").mkdir()
    on = write_config(tmp_path / "on", tiny_family, method="ties", parameters={"density": 0.33})
    for path, want in ((off, True), (on, False)):
        capsys.readouterr()
        main(["check", str(path)])
        assert ("exact cuts off the grid read at most" in capsys.readouterr().out) == want
