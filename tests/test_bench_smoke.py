"""The benchmark harness itself (bench/): measurement helpers and a smoke run on the
tiny family. Benchmarks are not tests; this only checks the machinery works."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import measure  # noqa: E402


def test_run_measured_reports_io_cpu_and_rss(tmp_path):
    data = tmp_path / "data.bin"
    data.write_bytes(b"\1" * (8 << 20))
    code = f"b = bytearray(64 << 20); b[::4096] = b'\\1' * len(b[::4096]); open({str(data)!r}, 'rb').read()"
    m = measure.run_measured([sys.executable, "-c", code])
    assert m.returncode == 0
    assert m.io["rchar"] >= 8 << 20  # /proc/<pid>/io read at exit (WNOWAIT), before the reap
    assert m.max_rss_bytes >= 64 << 20
    assert m.wall_s > 0 and m.cpu_s > 0
    bad = measure.run_measured([sys.executable, "-c", "import sys; sys.exit(3)"], log=tmp_path / "log")
    assert bad.returncode == 3


def test_evict_and_residency(tmp_path):
    f = tmp_path / "f.bin"
    f.write_bytes(b"\2" * (4 << 20))
    measure.evict([f])
    if measure.resident_bytes(f) != 0:
        pytest.skip("this filesystem keeps pages despite POSIX_FADV_DONTNEED")
    with open(f, "rb") as fh:
        fh.seek(1 << 20)
        fh.read(1 << 20)
    resident = measure.resident_bytes(f)
    assert 1 << 20 <= resident < 4 << 20
    measure.warm([f])
    assert measure.resident_bytes(f) == 4 << 20
    bw = measure.read_bandwidth([f], cold=False)
    assert bw["bytes"] == 4 << 20 and bw["gb_per_s"] > 0


@pytest.mark.slow
def test_smoke_suite_on_the_tiny_family(tmp_path, tiny_family):
    out = tmp_path / "bench"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "run.py"), "--suite", "smoke", "--family",
                        str(tiny_family["root"]), "--out", str(out),
                        "--sections", "bandwidth,head,budgets,equivalence"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads((out / "results.json").read_text())
    runs = res["runs"]
    assert {(x["tool"], x["section"], x["cache"]) for x in runs} == {
        ("mergepipe", "head", "warm"), ("naive", "head", "warm"), ("mergepipe", "budgets", "cold")}
    for x in runs:
        assert x["returncode"] == 0 and x["io"]["rchar"] > 0 and x["max_rss_bytes"] > 0
    budget_run = next(x for x in runs if x["section"] == "budgets")
    assert budget_run["expert_bytes_read"] <= budget_run["budget_bytes"]
    assert budget_run["expert_resident_before"] == 0 or not res["drop_caches_allowed"]
    assert res["equivalence"]["mergepipe vs naive (task_arithmetic)"]["max_abs"] == 0
    report = (out / "report.md").read_text()
    for heading in ("## Read bandwidth", "## Head-to-head", "## mergepipe at budgets", "## Targets"):
        assert heading in report
    assert not (out / "runs").exists()  # merged outputs are deleted unless --keep-outputs


@pytest.mark.slow
def test_adapter_bench_on_the_tiny_family(tmp_path, tiny_family):
    """bench/adapters.py writes PEFT adapters mergepipe reads, times cp and mergepipe alternated."""
    import adapters
    from mergepipe.checkpoint.lora_config import parse_settings

    family = tmp_path / "fam"
    shutil.copytree(tiny_family["root"] / "base", family / "base")
    out = tmp_path / "adapters.json"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "adapters.py"), "--family", str(family), "--ks", "2",
                        "--mergekit-ks", "", "--rounds", "2", "--rank", "4", "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert sorted((x["tool"], x["k"], x["round"]) for x in res["runs"]) == [
        ("cp", 0, 1), ("cp", 0, 2), ("mergepipe", 2, 0), ("mergepipe", 2, 1), ("mergepipe", 2, 2)]
    assert all(x["returncode"] == 0 and x["output_bytes"] > 0 for x in res["runs"])
    assert {(x["tool"], x["n"]) for x in res["summary"]} == {("cp", 2), ("mergepipe", 2)}
    folder = family / "adapter_r4_0"
    settings = parse_settings(json.loads((folder / "adapter_config.json").read_text()), "adapter_config.json")
    assert settings.r == 4
    with safe_open(folder / "adapter_model.safetensors", "pt") as st:
        keys = set(st.keys())
    assert {k.removeprefix("base_model.model.").removesuffix(".lora_A.weight") for k in keys
            if k.endswith("lora_A.weight")} == set(adapters.linear_shapes(family / "base"))
    assert not (family / "adapter-bench" / "runs" / "mergepipe-k2").exists()  # outputs removed after each run
