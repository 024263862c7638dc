"""The model card (README.md) of a merged folder, and `mergekit_config.yml` for a recipe
imported from mergekit: the files a Hub page is made of, in the shape mergekit's cards have
(front matter with base_model, library_name and tags; the method; the models merged; the
configuration as YAML), plus what this merge read under its budget and how to load it.

A function of the plan, the `Recipe` (the recipe's YAML) and the base's stack record, so the
same inputs give the same bytes. Experts are listed by name, never in the order a params.yaml
lists them: that order changes no byte of an output or its manifest (docs/design.md
"Determinism contract"), and the card is one of the output's files. No file I/O here but
reading a stack record.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mergepipe.methods import METHODS
from mergepipe.output.safety import CARD_TITLE
from mergepipe.plan.bound_text import bound_line

if TYPE_CHECKING:
    from mergepipe.plan.record import PlanRecord

README = "README.md"
MERGEKIT_CONFIG = "mergekit_config.yml"  # the name mergekit gives the recipe it writes into its output
CARD_FILES = (README, MERGEKIT_CONFIG)


@dataclass(frozen=True, slots=True)
class Recipe:
    """What the card says beyond the plan. `params_yaml`: the recipe as params.yaml (experts by
    name); `mergekit_yaml`: the mergekit YAML it was imported from, if it was."""

    params_yaml: str
    mergekit_yaml: str | None = None


def read_stack(path: Path) -> list[dict] | None:
    """The slices [{model, layer_range}] of a stacked base's stack.json (commands/stack.py),
    or None where `path` is no such record (absent, or some other file of that name)."""
    try:
        slices = json.loads(path.read_text(encoding="utf-8"))["slices"]
    except (OSError, ValueError, RecursionError, KeyError, TypeError):
        return None
    ok = isinstance(slices, list) and slices and all(
        isinstance(s, dict) and isinstance(s.get("model"), str) and isinstance(s.get("layer_range"), list)
        and len(s["layer_range"]) == 2 and all(isinstance(i, int) for i in s["layer_range"]) for s in slices)
    return slices if ok else None


def _fenced(text: str, lang: str) -> list[str]:
    """`text` in a code fence longer than any run of backticks inside it."""
    longest = max((len(m) for m in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return [f"{fence}{lang}", text.rstrip("\n"), fence]


def _experts_by_name(plan: PlanRecord) -> list[dict]:
    """The plan's expert entries (as its JSON has them) by name (names are unique in a plan):
    the order a user can find theirs in, and one no list order changes."""
    return sorted(plan.experts_json(), key=lambda e: e["name"])


def _unique(items: list[str]) -> list[str]:
    return list(dict.fromkeys(items))


def _plan_yaml(plan: PlanRecord, experts: list[dict]) -> str:
    """The merge's configuration from the plan alone (a plan file merged without its recipe)."""
    import yaml
    config = {"base": plan.base.path,
              "experts": [{k: e[k] for k in ("name", "path", "weight", "density", "gamma") if k in e}
                          for e in experts],
              "method": plan.method, "parameters": plan.parameters, "seed": plan.seed,
              "budget": plan.budget}
    if plan.tensor_parameters is not None:  # per-tensor parameters: the top-level values are not the merge's
        config["tensor_parameters"] = plan.tensor_parameters
    return yaml.safe_dump(config, sort_keys=False, default_flow_style=False, width=100)


def _reads(plan: PlanRecord) -> str:
    b = plan.bytes
    sketch = b.planned_sketch_bytes
    read = f"read {b.planned_expert_bytes:,} of {b.total_expert_bytes:,} expert bytes"
    if sketch is not None:
        read += f" and {sketch:,} bytes of sketches ({b.planned_expert_bytes + sketch:,} bytes in all)"
    return f"budget {plan.budget} ({plan.budget_bytes:,} bytes): {read}"


def model_card(plan: PlanRecord, *, recipe: Recipe | None = None, stack: list[dict] | None = None) -> str:
    """README.md: front matter (base_model: the base, then the experts in the user's order, or a
    stack's source models; library_name; tags), the method, the models merged, the
    configuration as YAML, what was read, and a usage snippet."""
    experts = _experts_by_name(plan)
    base = plan.base.path
    if stack is not None:
        models = _unique([s["model"] for s in stack])
    else:
        models = _unique([base, *(e["path"] for e in experts)])
    method = METHODS[plan.method]
    lines = ["---", "base_model:", *(f"- {json.dumps(m)}" for m in models), "base_model_relation: merge",
             "library_name: transformers", "tags:", "- merge", "- mergepipe", "---", "",
             f"{CARD_TITLE}{plan.method})", "",
             "This is a merge of pre-trained language models made with mergepipe.", "",
             "## Merge Details", "", "### Merge Method", "",
             f"This model was merged with the `{plan.method}` method ({method.paper}), "
             f"with `{base}` as the base.", ""]
    if stack is not None:
        lines += ["### Models Merged", "", "The layers of these models, stacked in this order:", ""]
        lines += [f"* `{s['model']}`: layers {s['layer_range'][0]} to {s['layer_range'][1] - 1}" for s in stack]
    else:
        lines += ["### Models Merged", "", "| model | name | weight | content |", "|---|---|---|---|"]
        lines += [f"| `{e['path']}` | {e['name']} | {e['weight']} | `{e['content_hash'][:16]}` |" for e in experts]
    lines += ["", "### Configuration", ""]
    if recipe is not None and recipe.mergekit_yaml is not None:
        lines += [f"Imported from this mergekit configuration (also in `{MERGEKIT_CONFIG}`):", "",
                  *_fenced(recipe.mergekit_yaml, "yaml"), "", "as this mergepipe recipe (params.yaml):", ""]
    else:
        lines += ["The following YAML configuration (mergepipe params.yaml) produced this model:", ""]
    lines += [*_fenced(recipe.params_yaml if recipe is not None else _plan_yaml(plan, experts), "yaml"), ""]
    bound = bound_line(plan.bound.model_dump())
    lines += ["## Reads", "", f"- {_reads(plan)}",
              f"- {bound}" if bound else "- nothing left out: the full merge",
              f"- plan hash: `{plan.plan_hash}`; base content `{plan.base.content_hash[:16]}`", "",
              "## Usage", "", "```python", "from transformers import AutoModelForCausalLM, AutoTokenizer", "",
              'path = "path/to/this/folder"  # or its Hub id once uploaded',
              'model = AutoModelForCausalLM.from_pretrained(path, dtype="auto")',
              "tokenizer = AutoTokenizer.from_pretrained(path)", "```", ""]
    return "\n".join(lines)


def card_files(plan: PlanRecord, *, recipe: Recipe | None = None, stack: list[dict] | None = None) -> dict[str, bytes]:
    """The card files of the output: README.md, and mergekit_config.yml for an imported recipe."""
    files = {README: model_card(plan, recipe=recipe, stack=stack).encode()}
    if recipe is not None and recipe.mergekit_yaml is not None:
        files[MERGEKIT_CONFIG] = recipe.mergekit_yaml.encode()
    return files
