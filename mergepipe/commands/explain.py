"""`mergepipe explain`: planned/realized bytes and the bound as readable tables."""
from __future__ import annotations

import json
from pathlib import Path

from mergepipe.errors import ConfigError
from mergepipe.output.manifest import MANIFEST, load_manifest


def _mib(n: int) -> str:
    return f"{n / 2**20:,.2f}"


def explain(target: Path) -> str:
    """Render a plan file, or an output folder's manifest, as markdown tables."""
    man = None
    if target.is_dir() or target.name == MANIFEST:
        man = load_manifest(target if target.is_dir() else target.parent)
        plan = man["plan"]
    else:
        try:
            plan = json.loads(target.read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"{target}: not a plan or output folder: {e}") from None
    b = plan["bytes"]
    realized = man["bytes"]["expert_bytes_read_by_expert"] if man else {}
    lines = [f"plan {plan['plan_hash'][:16]}  method {plan['method']}  budget {plan['budget']} "
             f"({_mib(plan['budget_bytes'])} MiB)", "",
             "| expert | weight | planned MiB | realized MiB | identical-to-base MiB (free) | total MiB |",
             "|---|---:|---:|---:|---:|---:|"]
    per_expert_total = {e["name"]: 0 for e in plan["experts"]}
    total_each = b["total_expert_bytes"] // max(1, len(plan["experts"]))
    for e in plan["experts"]:
        n = e["name"]
        per_expert_total[n] = total_each
        real = _mib(realized[n]) if n in realized else "-"
        lines.append(f"| {n} | {e['weight']} | {_mib(b['planned_by_expert'][n])} | {real} | "
                     f"{_mib(b['skipped_identical_by_expert'][n])} | {_mib(total_each)} |")
    lines += ["", f"planned {_mib(b['planned_expert_bytes'])} MiB of {_mib(b['total_expert_bytes'])} MiB "
                  f"({b['planned_pairs']} of {b['candidate_pairs']} non-identical (expert, block) pairs)"]
    bound = plan["bound"]
    lines.append(f"{bound['kind']} bound: ||M_S - M||_F <= {bound['omitted_mass']:.6g} "
                 f"(relative to estimated ||M - W0||: {bound['relative']:.4%})" if bound["kind"] == "certified" else
                 f"heuristic omitted mass {bound['omitted_mass']:.6g} (relative {bound['relative']:.4%}); "
                 "not a bound for this method")
    tensors: dict[str, dict[str, int]] = {}
    for ename, per in plan["reads"].items():
        for tname, blocks in per.items():
            tensors.setdefault(tname, {})[ename] = len(blocks)
    if tensors:
        names = [e["name"] for e in plan["experts"]]
        lines += ["", "| tensor | " + " | ".join(f"{n} blocks" for n in names) + " |",
                  "|---|" + "---:|" * len(names)]
        for tname in sorted(tensors):
            lines.append(f"| {tname} | " + " | ".join(str(tensors[tname].get(n, 0)) for n in names) + " |")
    return "\n".join(lines)
