"""mergekit 0.1.5's `chat_template` as params.yaml's `output.chat_template` (the template's text).

mergekit sets the output tokenizer's chat template, which transformers writes to
`chat_template.jinja` (merge.py `_set_chat_template`):
- `auto`: the most common template (stripped) among the models the recipe references, read
  from each model's tokenizer files; none: no template is set; a tie: mergekit takes the first in
  the order of a Python set of models (string hashes: it changes with PYTHONHASHSEED), here the
  template of the earliest model in the recipe (base_model, models, slices), one of mergekit's picks;
- a short name without `{` or a newline that names a template shipped inside mergekit's own
  package (alpaca, chatml, exaone, llama3, mistral): that file's text; here our own template of
  that format (config/chat_formats.py: other text, the same rendering);
- any other text of at least 20 characters holding `{`: the template itself; shorter or
  without `{`: an error.
The import resolves the value to the text once, from local files only (no tokenizer code is
run): the plan then covers the text, and the merge writes it (output/chat_template.py).
"""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from mergepipe.config.chat_formats import NAMED
from mergepipe.errors import ConfigError
from mergepipe.units import short_repr

JINJA = "chat_template.jinja"


def _referenced(data: dict[str, Any]) -> list[str]:
    """Every model reference of the recipe (base, models, slices' sources, modules'), as written."""
    refs = [data["base_model"]] if isinstance(data.get("base_model"), str) else []
    scopes = [data, *(m for m in (data.get("modules") or {}).values() if isinstance(m, dict))]
    for scope in scopes:
        refs += [m.get("model") for m in scope.get("models") or [] if isinstance(m, dict)]
        for s in scope.get("slices") or []:
            refs += [src.get("model") for src in (s or {}).get("sources") or [] if isinstance(src, dict)]
    return list(dict.fromkeys(r for r in refs if isinstance(r, str)))


def model_template(folder: Path) -> str | None:
    """A model folder's chat template as transformers loads it: chat_template.jinja, else
    tokenizer_config.json's `chat_template` (a list of named templates: the one named default)."""
    if (folder / JINJA).is_file():
        return (folder / JINJA).read_text(encoding="utf-8")
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    template = config.get("chat_template") if isinstance(config, dict) else None
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _auto(data: dict[str, Any], source: str, cwd: Path, warnings: list[str] | None) -> str | None:
    by_model = {}
    for ref in _referenced(data):
        folder = cwd / ref.split("+", 1)[0]  # a LoRA reference's tokenizer is its model's
        text = model_template(folder) if folder.is_dir() else None
        if text:
            by_model[ref] = text.strip()
    if not by_model:
        return None
    ranked = Counter(by_model.values()).most_common()  # equal counts: in recipe order (base first)
    tied = [t for t, n in ranked if n == ranked[0][1]]
    if len(tied) > 1 and warnings is not None:
        # mergekit takes the first of a tie in the order of a set of models (it moves with
        # PYTHONHASHSEED); here always the one of the earliest model in the recipe
        first = next(ref for ref, t in by_model.items() if t == ranked[0][0])
        warnings.append(f"warning: {source}: chat_template: 'auto' finds {len(tied)} templates used by equally many "
                        f"models; taking {first!r}'s (mergekit's pick among them is arbitrary)")
    return ranked[0][0]


def chat_template_text(data: dict[str, Any], source: str, cwd: Path, warnings: list[str] | None = None) -> str | None:
    """`output.chat_template` for the recipe's `chat_template` (None: not set, or `auto` finding none).

    Raises:
        ConfigError: text mergekit calls invalid, or not a string; one line naming the key. A tie
            under `auto` takes the template of the earliest model in the recipe, one line on `warnings`.
    """
    value = data.get("chat_template")
    if value in (None, ""):
        return None
    if not isinstance(value, str):
        raise ConfigError(f"{source}: chat_template: expected a string, got {short_repr(value)}")
    if value == "auto":
        return _auto(data, source, cwd, warnings)
    if len(value) < 256 and "\n" not in value and "{" not in value and value in NAMED:
        return NAMED[value]  # the format mergekit's packaged template of that name renders
    if len(value) < 20 or "{" not in value:
        raise ConfigError(f"{source}: chat_template: invalid chat template {short_repr(value)} (as mergekit: "
                          "'auto', a template name, or template text of 20+ characters with '{')")
    return value
