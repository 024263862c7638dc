"""The compiled bf16 kernels (C, and the numba fallback) give the torch path's bytes, block by
block and end to end."""
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mergepipe.methods import _ckernels, _kernels as numba_kernels
from mergepipe.config.params import load_config
from mergepipe.engine.merge import run_merge
from mergepipe.methods import get_method
from mergepipe.methods._common import magnitude_rank
from mergepipe.methods.base import BlockInputs, ExpertBlock, RankCut
from mergepipe.commands.pipeline import plan_config
from mergepipe.index.store import Store
from mergepipe.util import cpu
from mergepipe.plan.record import plan_json
from tests.helpers import kernel_build, write_config

# both builds of the kernels: C (what installs use) and numba (the fallback without a compiler)
BACKENDS = pytest.mark.parametrize("merge_kernels", [_ckernels.load(), numba_kernels], ids=["c", "numba"])

EDGE = torch.tensor([0.0, -0.0, 1e-40, -1e-40, 3e38, -3e38, 1.0, -1.0, 0.5, 2 ** -126, 65504.0, 1e-3],
                    dtype=torch.float32)


def _bf16_block(g: torch.Generator, n: int, scale: float) -> torch.Tensor:
    x = (torch.randn(n, generator=g) * scale).to(torch.bfloat16)
    edge = torch.randint(0, len(EDGE), (n,), generator=g)
    pick = torch.rand(n, generator=g) < 0.05
    x[pick] = EDGE[edge[pick]].to(torch.bfloat16)
    return x


def _u16(x: torch.Tensor) -> np.ndarray:
    return x.view(torch.int16).numpy().view(np.uint16).copy()


def _family(seed: int, n: int, k: int):
    g = torch.Generator().manual_seed(seed)
    base = _bf16_block(g, n, 1.0)
    experts = []
    for _ in range(k):
        e = (base.float() + torch.randn(n, generator=g) * 0.01).to(torch.bfloat16)
        same = torch.rand(n, generator=g) < 0.3  # many deltas exactly 0, and many equal |delta|
        e[same] = base[same]
        edge = torch.rand(n, generator=g) < 0.02
        e[edge] = _bf16_block(g, int(edge.sum()), 1.0)
        experts.append(e)
    return g, base, experts


def test_the_c_kernels_are_built_and_used():
    # an install builds the C library (pyproject ext-modules); the engine then never needs numba
    from mergepipe.methods._compiled import kernels
    assert _ckernels.load() is not None
    assert kernels() is _ckernels.load()


@BACKENDS
@given(st.integers(0, 10_000), st.integers(1, 3000), st.integers(1, 5),
       st.sampled_from([1.0, 0.8, 0.3, 2.5]), st.booleans(),
       st.lists(st.sampled_from([1.0, 0.5, 0.7, 0.3, -0.4, 0.0]), min_size=5, max_size=5))
def test_task_arithmetic_kernel_is_bit_identical(merge_kernels, seed, n, k, lambda_, normalize, weights):
    _, base, experts = _family(seed, n, k)
    method = get_method("task_arithmetic")
    params = method.params.model_validate({"lambda": lambda_, "normalize": normalize})
    blocks = tuple(ExpertBlock(f"e{i}", f"{i:064x}", weights[i], experts[i].float() - base.float())
                   for i in range(k))
    want = method.fn(BlockInputs("t", 0, n, (n,), base.float(), blocks, 0), params).to(torch.bfloat16)
    plan_experts = [{"name": f"e{i}", "weight": weights[i]} for i in range(k)]
    km = method.compiled(params, plan_experts)
    out = np.empty(n, np.uint16)
    merge_kernels.task_arithmetic_bf16(_u16(base), tuple(_u16(e) for e in experts),
                                       np.array(weights[:k], np.float32), km.divisor, normalize,
                                       np.float32(lambda_), lambda_ != 1, out)
    assert out.tobytes() == _u16(want).tobytes()


@BACKENDS
@given(st.integers(0, 10_000), st.integers(1, 3000), st.integers(1, 5),
       st.sampled_from([1.0, 0.8, 2.5]), st.booleans(),
       st.lists(st.sampled_from([1.0, 0.5, 0.7, 0.3, -0.4]), min_size=5, max_size=5),
       st.lists(st.sampled_from(["keep", "drop", "cut"]), min_size=5, max_size=5),
       st.lists(st.integers(0, 50), min_size=5, max_size=5))
def test_ties_kernel_is_bit_identical(merge_kernels, seed, n, k, lambda_, normalize, weights, modes, eq_keeps):
    g, base, experts = _family(seed, n, k)
    method = get_method("ties")
    params = method.params.model_validate({"lambda": lambda_, "normalize": normalize})
    tensor_numel = 100 * n  # a cut's rank is somewhere inside the whole tensor
    blocks, kmodes, values = [], [], []
    for i in range(k):
        delta = experts[i].float() - base.float()
        if modes[i] == "keep":
            density, cut, mode, value = 1.0, None, merge_kernels.KEEP_ALL, 0.0
        elif modes[i] == "drop":
            density, cut, mode, value = 0.0, None, merge_kernels.DROP_ALL, 0.0
        else:
            density, mode = 0.5, merge_kernels.CUT
            mags = delta.abs()
            value = float(mags[int(torch.randint(0, n, (1,), generator=g))])  # often shared by many elements
            cut = (lambda v, e: lambda rank: RankCut(rank, v, e))(value, eq_keeps[i])
        rank = magnitude_rank(density, tensor_numel)
        assert (rank is None) == (modes[i] == "keep")
        blocks.append(ExpertBlock(f"e{i}", f"{i:064x}", weights[i], delta, density=density, cut=cut))
        kmodes.append(mode)
        values.append(value)
    want = method.fn(BlockInputs("t", 0, n, (tensor_numel // n, n), base.float(), tuple(blocks), 0),
                     params).to(torch.bfloat16)
    limits = np.array([merge_kernels.eq_limit(_u16(base), _u16(experts[i]), np.float32(values[i]), eq_keeps[i])
                       for i in range(k)], np.int64)
    out = np.empty(n, np.uint16)
    merge_kernels.ties_bf16(_u16(base), tuple(_u16(e) for e in experts), np.array(weights[:k], np.float32),
                            np.array(kmodes, np.int64), np.array(values, np.float32), limits, normalize,
                            np.float32(lambda_), lambda_ != 1, out)
    assert out.tobytes() == _u16(want).tobytes()


@pytest.mark.parametrize("method,parameters,budget", [
    ("task_arithmetic", {"lambda": 0.8}, "full"),
    ("task_arithmetic", {"lambda": 1.0, "normalize": True}, "40%"),
    ("ties", {"lambda": 1.0, "density": 0.5}, "full"),
    ("ties", {"lambda": 0.7, "density": 0.3, "normalize": False}, "30%"),
])
def test_engine_compiled_equals_torch_path(tmp_path, tiny_family, method, parameters, budget):
    cfg = load_config(write_config(tmp_path, tiny_family, method=method, parameters=parameters, budget=budget))
    store = Store(cfg.cache_dir)
    plan, inputs = plan_config(cfg, store)
    plan = plan_json(plan)  # the engine takes the plan's JSON form
    outs = []
    for compiled in (True, False):
        d = Path(tmp_path / f"o{int(compiled)}")
        d.mkdir()
        outs.append(run_merge(plan, inputs, d, compiled=compiled))
    assert outs[0].tensors == outs[1].tensors
    assert outs[0].files == outs[1].files


@pytest.mark.parametrize("output", [{"dtype": None, "shard_bytes": None}, {"dtype": None, "shard_bytes": "1MiB"},
                                    {"dtype": "float32", "shard_bytes": None}])
def test_output_hashed_while_writing_equals_the_file(tmp_path, tiny_family, monkeypatch, output):
    """File and tensor hashes (block trees) are composed while writing (no reread), and equal a reread."""
    from mergepipe.checkpoint.treehash import hash_weight_file
    from mergepipe.engine import merge as engine
    cfg = load_config(write_config(tmp_path, tiny_family, method="ties", parameters={"density": 0.5},
                                   budget="50%", output={"dir": str(tmp_path / "out"), **output}))
    plan, inputs = plan_config(cfg, Store(cfg.cache_dir))
    plan = plan_json(plan)  # the engine takes the plan's JSON form
    rehash = engine.hash_file
    def no_weight_rereads(path, *a):
        assert not str(path).endswith(".safetensors"), f"reread {path}"
        return rehash(path)

    monkeypatch.setattr(engine, "hash_file", no_weight_rereads)
    monkeypatch.setattr(engine, "hash_weight_file", no_weight_rereads)
    d = tmp_path / "o"
    d.mkdir()
    realized = run_merge(plan, inputs, d)
    weight_files = [f for f in realized.files if f.endswith(".safetensors")]
    assert len(weight_files) == 1 if output["shard_bytes"] is None else len(weight_files) > 1
    tensors = {}
    for fname in weight_files:
        digest, per_tensor = hash_weight_file(d / fname, plan["block_bytes"])
        assert realized.files[fname]["tree"] == digest
        tensors.update(per_tensor)
    assert realized.tensors == tensors


@pytest.mark.parametrize("method", ["task_arithmetic", "ties"])
def test_compiled_merges_never_import_torch(tmp_path, tiny_family, method):
    """bf16 task arithmetic and TIES merge through the kernels (numpy + numba) and copies: a whole
    `mergepipe run` (config, index, plan, merge, verify) does not import torch (util/lazy.py)."""
    import subprocess
    import sys
    cfg = write_config(tmp_path, tiny_family, method=method, budget="50%",
                       parameters={"density": 0.5} if method == "ties" else {"lambda": 1.0})
    code = ("import sys; from mergepipe.cli import main; assert main(['run', sys.argv[1], '-q']) == 0; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    proc = subprocess.run([sys.executable, "-c", code, str(cfg)], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.parametrize("method", ["task_arithmetic", "ties"])
def test_merges_from_a_cached_index_never_import_numba(tmp_path, tiny_family, method):
    """A bf16 merge runs the C kernels and the index is built by C kernels too: numba (~0.7 s of
    import and kernel loading per process) is imported only where a library was not built."""
    import subprocess
    import sys
    params = {"density": 0.5} if method == "ties" else {"lambda": 1.0}
    code = ("import sys; from mergepipe.cli import main; assert main(['run', sys.argv[1], '-q']) == 0; "
            "print('numba' in sys.modules)")
    seen = []
    for budget in ("50%", "30%"):  # the first run indexes; the second plans from the cache
        (tmp_path / budget.rstrip("%")).mkdir()
        cfg = write_config(tmp_path / budget.rstrip("%"), tiny_family, method=method, budget=budget,
                           parameters=params, cache_dir=str(tmp_path / "cache"))
        proc = subprocess.run([sys.executable, "-c", code, str(cfg)], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parents[1])
        assert proc.returncode == 0, proc.stderr[-2000:]
        seen.append(proc.stdout.strip())
    from mergepipe.index import ckernels
    assert seen == [str(ckernels._open_c() is None), "False"]


@pytest.mark.parametrize("level", cpu.BUILT, ids=[cpu.NAMES[v] for v in cpu.BUILT])
def test_every_vector_width_gives_the_same_bytes(level):
    """Each installed build (SSE2, AVX2, AVX-512), where this CPU runs it, against the numba
    kernels on blocks with edge values, ties and NaN."""
    import ctypes
    kernels = _ckernels._bind(ctypes.CDLL(str(kernel_build(_ckernels.MODULE, level))), cpu.NAMES[level])
    for seed, n, k in [(1, 4099, 1), (2, 3000, 3), (3, 2048, 4), (4, 517, 5)]:
        g, base, experts = _family(seed, n, k)
        b, es = _u16(base), tuple(_u16(e) for e in experts)
        w = np.array([1.0, 0.5, -0.4, 0.7, 0.3][:k], np.float32)
        for normalize, lam in [(False, 1.0), (True, 0.8)]:
            got, want = np.empty(n, np.uint16), np.empty(n, np.uint16)
            args = (np.float32(w.sum()), normalize, np.float32(lam), lam != 1)
            kernels.task_arithmetic_bf16(b, es, w, *args, got)
            numba_kernels.task_arithmetic_bf16(b, es, w, *args, want)
            assert got.tobytes() == want.tobytes()
            modes = np.array([numba_kernels.CUT, numba_kernels.KEEP_ALL, numba_kernels.CUT, numba_kernels.DROP_ALL,
                              numba_kernels.CUT][:k], np.int64)
            values = np.array([float(abs(experts[i].float() - base.float())[i]) for i in range(k)], np.float32)
            limits = np.array([kernels.eq_limit(b, es[i], values[i], 3) for i in range(k)], np.int64)
            assert limits.tolist() == [numba_kernels.eq_limit(b, es[i], values[i], 3) for i in range(k)]
            targs = (w, modes, values, limits, normalize, np.float32(lam), lam != 1)
            kernels.ties_bf16(b, es, *targs, got)
            numba_kernels.ties_bf16(b, es, *targs, want)
            assert got.tobytes() == want.tobytes()


def _build(level: int):
    import ctypes
    return _ckernels._bind(ctypes.CDLL(str(kernel_build(_ckernels.MODULE, level))), cpu.NAMES[level])


@pytest.mark.parametrize("level", cpu.BUILT, ids=[cpu.NAMES[v] for v in cpu.BUILT])
def test_ties_limits_anywhere_in_a_chunk_give_the_numba_bytes(level):
    """Each expert's limit (where threshold-equal |delta| stop being kept) at chunk edges, inside
    a chunk, several in one chunk, before the block and past it: every build equals numba."""
    kernels = _build(level)
    n = 3 * 1024 + 37  # four chunks of the kernels' 1024 elements, the last one short
    for seed, k in [(5, 1), (6, 2), (7, 3), (8, 4), (9, 5)]:
        g, base, experts = _family(seed, n, k)
        b, es = _u16(base), tuple(_u16(e) for e in experts)
        w = np.array([1.0, 0.5, -0.4, 0.7, 0.3][:k], np.float32)
        deltas = [(e.float() - base.float()).abs() for e in experts]
        values = np.array([float(d[d > 0].min()) if i % 2 else 0.0 for i, d in enumerate(deltas)], np.float32)
        modes = np.full(k, numba_kernels.CUT, np.int64)
        for limits in ([0] * k, [n] * k, [1024] * k, [1023, 1024, 1025, 2048, n - 1][:k],
                       [700, 701, 950, 3, 1024][:k], [-5, n + 9, 2047, 0, 3072][:k]):
            limits = np.array(limits, np.int64)
            for normalize, lam in [(True, 1.0), (False, 0.8)]:
                got, want = np.empty(n, np.uint16), np.empty(n, np.uint16)
                targs = (w, modes, values, limits, normalize, np.float32(lam), lam != 1)
                kernels.ties_bf16(b, es, *targs, got)
                numba_kernels.ties_bf16(b, es, *targs, want)
                assert got.tobytes() == want.tobytes(), (seed, k, limits.tolist(), normalize)


@pytest.mark.parametrize("level", cpu.BUILT, ids=[cpu.NAMES[v] for v in cpu.BUILT])
def test_eq_limit_at_every_count_equals_numba(level):
    """eq_limit for every eq_keep from 0 to one past the count of threshold-equal elements, the
    equal elements spread over several chunks."""
    kernels = _build(level)
    g, base, experts = _family(11, 5000, 1)
    b, e = _u16(base), _u16(experts[0])
    for value in (0.0, float((experts[0].float() - base.float()).abs()[17])):
        count = int(((experts[0].float() - base.float()).abs() == value).sum())
        assert count > 1
        for eq_keep in range(count + 2):
            assert kernels.eq_limit(b, e, np.float32(value), eq_keep) == \
                numba_kernels.eq_limit(b, e, np.float32(value), eq_keep)


def _sketch_reference(base: torch.Tensor, sketches, w, normalize, lam, *, ties: bool) -> bytes:
    """The torch path's fp32 operations on sketched deltas (alpha * code, untrimmed), in
    canonical order: task arithmetic's weighted sum, or TIES's sign election over it."""
    from mergepipe.index.sketch import unpack
    n = base.numel()
    b = base.float().numpy()
    terms = [unpack(codes, n, alpha) * w[i] for i, (codes, alpha) in enumerate(sketches)]
    if not ties:
        acc = terms[0]
        for t in terms[1:]:
            acc = acc + t
        acc = acc / np.float32(w.sum()) if normalize else acc
        acc = acc * np.float32(lam) if lam != 1 else acc
    else:
        total = terms[0]
        for t in terms[1:]:
            total = total + t
        positive = total >= 0
        agree = [np.where(positive, t > 0, t < 0).astype(np.float32) for t in terms]
        acc, div = terms[0] * agree[0], agree[0] * w[0]
        for i in range(1, len(terms)):
            acc, div = acc + terms[i] * agree[i], div + agree[i] * w[i]
        acc = acc / np.where(div == 0, np.float32(1), div) if normalize else acc
        acc = acc * np.float32(lam)
    out = torch.from_numpy(b + acc).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    return np.where(np.isnan(b + acc), np.uint16(0x7FC0), out).tobytes()  # the kernels' one NaN


@pytest.mark.parametrize("level", cpu.BUILT, ids=[cpu.NAMES[v] for v in cpu.BUILT])
def test_blocks_of_sketches_only_give_the_torch_bytes_at_every_build(level):
    """A block where every expert is a sketch (merged through one table of code combinations
    per block, up to 4 experts; past that, the chunked loops), at each build: the torch
    path's bytes, for 1-5 experts, negative weights (0 * w is -0), a NaN/inf base and
    blocks whose length is no multiple of 4."""
    from mergepipe.index.sketch import block_sketch
    kernels = _build(level)
    for seed, n, k in [(11, 1, 1), (12, 4099, 2), (13, 3000, 3), (14, 2049, 4), (15, 1027, 5), (16, 6, 4)]:
        g, base, experts = _family(seed, n, k)
        base[: min(n, 3)] = torch.tensor([float("nan"), float("inf"), -0.0][: min(n, 3)]).to(torch.bfloat16)
        b = _u16(base)
        sketches = []
        for e in experts:
            codes, alpha = block_sketch(e.float().numpy() - base.float().numpy())[:2]
            sketches.append((bytes(codes), float(alpha)))
        w = np.array([1.0, -0.5, 0.7, -0.4, 0.3][:k], np.float32)
        for normalize, lam in [(False, 1.0), (True, 0.8), (True, 1.0)]:
            for ties, fn in [(False, kernels.task_arithmetic_sketch_bf16), (True, kernels.ties_sketch_bf16)]:
                got = np.empty(n, np.uint16)
                if ties:
                    trims = (np.full(k, kernels.KEEP_ALL, np.int64), np.zeros(k, np.float32), np.zeros(k, np.int64))
                    fn(b, sketches, w, *trims, normalize, np.float32(lam), lam != 1, got)
                else:
                    fn(b, sketches, w, np.float32(w.sum()), normalize, np.float32(lam), lam != 1, got)
                want = _sketch_reference(base, sketches, w, normalize, lam, ties=ties)
                assert got.tobytes() == want, (seed, k, normalize, lam, ties)
