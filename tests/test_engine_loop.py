"""The engine loop (engine/merge.py, engine/work.py): the plan record as its input, the work
list's typed items covering every block once, in order."""
import pytest

from mergepipe.commands.pipeline import plan_config
from mergepipe.config.params import load_config
from mergepipe.engine.merge import run_merge
from mergepipe.engine.work import CopyPack, CopySpan, MergePack, MergeSpan
from mergepipe.errors import ConfigError
from mergepipe.index.store import Store
from mergepipe.plan.record import PlanRecord, validate_plan
from tests.helpers import write_config


def _record_and_json(plan) -> tuple[PlanRecord, dict]:
    """The plan as its typed record and as its JSON form, whichever plan_config gave."""
    if isinstance(plan, PlanRecord):
        from mergepipe.plan import record
        return plan, record.plan_json(plan)
    return validate_plan(plan, "test"), plan


@pytest.fixture
def planned(tmp_path, tiny_family):
    cfg = load_config(write_config(tmp_path, tiny_family, method="ties", parameters={"density": 0.5},
                                   budget="30%"))
    plan, inputs = plan_config(cfg, Store(cfg.cache_dir))
    return (*_record_and_json(plan), inputs)


def test_a_record_and_its_json_form_merge_to_the_same_bytes(tmp_path, planned):
    rec, doc, inputs = planned
    outs = []
    for name, plan in (("record", rec), ("json", doc)):
        d = tmp_path / name
        d.mkdir()
        outs.append(run_merge(plan, inputs, d))
    assert outs[0].files == outs[1].files and outs[0].tensors == outs[1].tensors
    assert outs[0].expert_bytes_read == outs[1].expert_bytes_read
    for fname in outs[0].files:
        assert (tmp_path / "record" / fname).read_bytes() == (tmp_path / "json" / fname).read_bytes(), fname


def test_a_bad_plan_dict_is_refused_at_the_entry_naming_its_key(tmp_path, planned):
    _, doc, inputs = planned
    d = tmp_path / "out"
    d.mkdir()
    with pytest.raises(ConfigError, match=r"^plan: plan key seed: "):
        run_merge({**doc, "seed": -1}, inputs, d)
    assert list(d.iterdir()) == []  # refused before a file is opened


def test_the_work_list_covers_every_block_once_in_base_order(tmp_path, planned, monkeypatch):
    """Spans of one tensor are adjacent and in block order, the last one marked; packs take
    whole single-block tensors; every tensor of the base appears, in its order."""
    from mergepipe.engine import merge as engine
    rec, _, inputs = planned
    seen = []
    real = engine.work_list
    monkeypatch.setattr(engine, "work_list", lambda *a, **kw: seen.append(real(*a, **kw)) or seen[-1])
    d = tmp_path / "out"
    d.mkdir()
    run_merge(rec, inputs, d)
    work = seen[0]
    kinds = {type(w) for w in work}
    assert MergeSpan in kinds and CopySpan in kinds, kinds  # a 30% budget merges some blocks and keeps others
    order, blocks = [], {}
    for w in work:
        if isinstance(w, MergePack | CopyPack):
            order += w.pack.names
            blocks.update({n: [0] for n in w.pack.names})
            continue
        if not blocks.get(w.tensor):
            order.append(w.tensor)
        blocks.setdefault(w.tensor, []).extend(w.blocks)
        assert w.last == (w.blocks[-1] == len(inputs.base_index.tensors[w.tensor].ranges) - 1)
    assert order == list(inputs.base.tensors.names)
    for name, got in blocks.items():
        assert got == list(range(len(inputs.base_index.tensors[name].ranges))), name
