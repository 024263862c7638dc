"""mergekit 0.1.5's named chat templates (`chat_template: chatml`, ...) as our own templates
(config/chat_formats.py): the names are those of mergekit's package, the text is not mergekit's,
and on a set of conversations (system, user, assistant, mergekit alpaca's user_context; with
add_generation_prompt on and off) both render the same strings with jinja2 under transformers'
chat template settings, and refuse the same conversations. mergekit's files are read from the
reference venv (skipped without it); the import of a name gives our template."""
from __future__ import annotations

import itertools

import pytest
import yaml

from mergepipe.config.chat_formats import NAMED
from mergepipe.config.mergekit import mergekit_to_params
from mergepipe.config.mergekit_chat import chat_template_text
from tests.helpers.equivalence import MERGEKIT_PYTHON

jinja2 = pytest.importorskip("jinja2")
from jinja2.sandbox import ImmutableSandboxedEnvironment  # noqa: E402

PACKAGE = next(MERGEKIT_PYTHON.parent.parent.glob("lib/python3*/site-packages/mergekit/_data/chat_templates"), None)
needs_mergekit = pytest.mark.skipif(PACKAGE is None, reason=f"mergekit reference venv not found at {MERGEKIT_PYTHON}")


def _turn(role: str):
    return lambda content: {"role": role, "content": content}


S, U, A, C = _turn("system"), _turn("user"), _turn("assistant"), _turn("user_context")
CONVERSATIONS = [
    [U("hi")], [U("hi"), A("hello")], [S("be brief"), U("hi"), A("ok"), U("more")], [S(" sys \n"), U("  q \n")],
    [U("a"), A(" b "), U("c"), A("d")], [S("x"), S("y"), U("z")], [U("a"), C("ctx"), A("b")], [S("only")],
    [U("a"), A("b"), S("late")],
    [A("first")], [U("a"), U("b")], [S("x"), U("a"), S("y")],  # mistral refuses these three
]


def _environment() -> ImmutableSandboxedEnvironment:
    """jinja2 as transformers renders a chat template (trim_blocks, lstrip_blocks, loopcontrols,
    raise_exception)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env.globals["raise_exception"] = raise_exception
    return env


def _render(text: str, messages: list[dict], generation_prompt: bool) -> tuple[str, str]:
    try:
        return "rendered", _environment().from_string(text).render(
            messages=messages, add_generation_prompt=generation_prompt, bos_token="<s>", eos_token="</s>")
    except jinja2.exceptions.TemplateError as err:
        return "refused", type(err).__name__


@needs_mergekit
def test_names_are_mergekits():
    assert sorted(NAMED) == sorted(p.stem for p in PACKAGE.glob("*.jinja"))


@needs_mergekit
@pytest.mark.parametrize("name", sorted(NAMED))
def test_renders_as_mergekits_template(name):
    theirs = (PACKAGE / f"{name}.jinja").read_text(encoding="utf-8")
    assert NAMED[name] != theirs
    outcomes = set()
    for messages, generation_prompt in itertools.product(CONVERSATIONS, (False, True)):
        ours = _render(NAMED[name], messages, generation_prompt)
        assert ours == _render(theirs, messages, generation_prompt), (messages, generation_prompt)
        outcomes.add(ours[0])
    assert "rendered" in outcomes


@needs_mergekit
def test_mistral_refuses_what_mergekits_refuses():
    theirs = (PACKAGE / "mistral.jinja").read_text(encoding="utf-8")
    for messages in CONVERSATIONS[-3:]:
        assert _render(NAMED["mistral"], messages, False)[0] == "refused"
        assert _render(theirs, messages, False)[0] == "refused"


@pytest.mark.parametrize("name", sorted(NAMED))
def test_a_name_imports_as_our_template(name, tmp_path):
    recipe = {"merge_method": "linear", "base_model": "b", "chat_template": name,
              "models": [{"model": "b", "parameters": {"weight": 1}}, {"model": "e", "parameters": {"weight": 1}}]}
    assert chat_template_text(recipe, "mk.yml", tmp_path) == NAMED[name]
    mergekit_to_params(yaml.safe_load(yaml.safe_dump(recipe)), source="mk.yml")  # not refused
