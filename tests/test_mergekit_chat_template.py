"""`chat_template` of a mergekit recipe, through `import-mergekit` + `run`, against mergekit 0.1.5's
output on the tokenizer acceptance family (tests/test_mergekit_tokenizer_accept.py), whose models are
given templates here: the base one in tokenizer_config.json, `padded` another in chat_template.jinja
(with a trailing newline, which `auto` strips) and `special` that one in tokenizer_config.json.

Compared: chat_template.jinja's bytes, tokenizer_config.json (parsed; mergekit's re-saved file also
holds transformers' loading flags `is_local` and `local_files_only`), and the template transformers
loads from each output and what it renders. A template named after one in mergekit's package
(`chatml`) is our own text of that format (config/chat_formats.py): there the rendering is compared,
not the text. A value mergekit refuses is refused by the import. An `auto` tie: mergekit takes one
of the tied templates by set order (PYTHONHASHSEED), the import the earliest model's, with one
warning line. Skipped without the mergekit reference venv.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mergepipe.config.chat_formats import NAMED
from tests.helpers.equivalence import INSTALL, MERGEKIT_PYTHON
from tests.helpers.mergekit_tokenizers import run_cases

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not MERGEKIT_PYTHON.exists(),
                       reason=f"mergekit reference venv not found at {MERGEKIT_PYTHON}; create it with: {INSTALL}"),
]

T_BASE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
T_SHARED = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
LITERAL = "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}{% endfor %}"
TRANSFORMERS_FLAGS = ("is_local", "local_files_only")  # loading kwargs transformers' save_pretrained writes

RENDER = r'''
import json, sys
from transformers import AutoTokenizer
out = {}
for folder in sys.argv[1:]:
    tok = AutoTokenizer.from_pretrained(folder)
    chat = [{"role": "user", "content": "_tok_5"}, {"role": "assistant", "content": "_tok_7"}]
    out[folder] = [tok.chat_template, tok.apply_chat_template(chat, tokenize=False)]
print(json.dumps(out))
'''


def _recipe(models: list[str], template: str | None, tokenizer_source: str | None = None, base: str = "base") -> dict:
    return {"merge_method": "linear", "base_model": base, "dtype": "float32",
            "models": [{"model": m, "parameters": {"weight": 1.0}} for m in models],
            **({} if tokenizer_source is None else {"tokenizer_source": tokenizer_source}),
            **({} if template is None else {"chat_template": template})}


MATCHED = {
    "literal": _recipe(["base", "padded"], LITERAL),
    "literal[source_base]": _recipe(["base", "padded", "special"], LITERAL, "base"),
    "auto": _recipe(["base", "padded", "special"], "auto", "base"),
    "base_jinja_copied": _recipe(["base", "padded"], None, base="padded"),  # no chat_template: the base's file
}
NAMED_CASES = {f"named[{name}]": _recipe(["base", "padded"], name) for name in ("chatml", "llama3")}
REFUSED_BY_BOTH = {"invalid": _recipe(["base", "padded"], "no_such_template", "base")}  # without a
# tokenizer_source mergekit logs the error and writes no tokenizer files; the import refuses it too
AUTO_TIE = {"auto_tie": _recipe(["base", "padded"], "auto", "base")}  # base and padded: one template each


def _give_templates(family: Path) -> None:
    for name, template in (("base", T_BASE), ("special", T_SHARED)):
        path = family / name / "tokenizer_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "chat_template": template}, indent=2))
    (family / "padded" / "chat_template.jinja").write_text(T_SHARED + "\n")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{case: (our output or None, mergekit's output folder, mergekit's error, our stderr)}."""
    cases = {**MATCHED, **NAMED_CASES, **AUTO_TIE, **REFUSED_BY_BOTH}
    return run_cases(tmp_path_factory.mktemp("mk_chat_template"), cases, prepare=_give_templates)


def _config(folder: Path) -> dict:
    config = json.loads((folder / "tokenizer_config.json").read_text())
    return {k: v for k, v in config.items() if k not in TRANSFORMERS_FLAGS}


@pytest.mark.parametrize("case", list(MATCHED))
def test_chat_template_matches_mergekit(case, runs):
    ours, theirs, their_error, our_error = runs[case]
    assert their_error is None, their_error
    assert ours is not None, our_error
    assert (ours / "chat_template.jinja").read_bytes() == (theirs / "chat_template.jinja").read_bytes()
    assert _config(ours) == _config(theirs)
    rendered = _rendered(ours, theirs)
    assert rendered[str(ours)] == rendered[str(theirs)]


@pytest.mark.parametrize("case", list(NAMED_CASES))
def test_named_template_renders_as_mergekits(case, runs):
    ours, theirs, their_error, our_error = runs[case]
    assert their_error is None, their_error
    assert ours is not None, our_error
    name = NAMED_CASES[case]["chat_template"]
    assert (ours / "chat_template.jinja").read_text(encoding="utf-8") == NAMED[name]
    assert _config(ours) == _config(theirs)
    (our_template, our_text), (their_template, their_text) = (_rendered(ours, theirs)[str(f)] for f in (ours, theirs))
    assert our_template != their_template and our_text == their_text


def _rendered(*folders: Path) -> dict[str, list[str]]:
    """{folder: [the template transformers loads, its rendering of a user and an assistant turn]}."""
    proc = subprocess.run([sys.executable, "-c", RENDER, *map(str, folders)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_auto_tie_takes_one_of_mergekits_picks(runs):
    ours, theirs, their_error, our_error = runs["auto_tie"]
    assert their_error is None, their_error
    assert ours is not None, our_error
    assert (theirs / "chat_template.jinja").read_text() in (T_BASE, T_SHARED)
    assert (ours / "chat_template.jinja").read_text() == T_BASE  # the base's: the earliest model
    assert "chat_template: 'auto' finds 2 templates used by equally many models; taking 'base'" in our_error


@pytest.mark.parametrize("case", list(REFUSED_BY_BOTH))
def test_chat_template_refused_like_mergekit(case, runs):
    ours, _, their_error, _ = runs[case]
    assert their_error is not None and ours is None
