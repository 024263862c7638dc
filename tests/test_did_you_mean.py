"""Where an error lists the choices, it also names the closest one: `method: tie` says "did you
mean 'ties'" (difflib), for methods, strategies, config keys and parameter names."""
from __future__ import annotations

import pytest

from mergepipe.config.mergekit import mergekit_to_params
from mergepipe.config.params import config_from_dict
from mergepipe.errors import ConfigError

MERGEKIT = {"merge_method": "ties", "base_model": "b", "models": [{"model": "e", "parameters": {"weight": 1}}]}
PARAMS = {"base": "b", "experts": [{"name": "e", "path": "e", "weight": 1.0}], "method": "ties",
          "parameters": {"density": 0.5}}


def _message(fn, doc) -> str:
    with pytest.raises(ConfigError) as info:
        fn(doc)
    assert "\n" not in str(info.value)
    return str(info.value)


@pytest.mark.parametrize("doc, expected", [
    ({**MERGEKIT, "merge_method": "tie"}, "merge_method: 'tie' has no mergepipe equivalent (did you mean 'ties'?)"),
    ({**MERGEKIT, "merge_method": "dare-ties"}, "(did you mean 'dare_ties'?)"),
    ({**MERGEKIT, "base_modle": "b"}, "base_modle: unknown mergekit key (did you mean 'base_model'?)"),
    ({**MERGEKIT, "models": [{"modle": "e"}]}, "models[0].modle: unknown key (did you mean 'model'?)"),
    ({**MERGEKIT, "models": [{"model": "e", "parameters": {"wieght": 1}}]},
     "per-model 'wieght' cannot be expressed (did you mean 'weight'?)"),
])
def test_mergekit_errors_name_the_closest_choice(doc, expected):
    message = _message(lambda d: mergekit_to_params(d, source="mk.yml"), doc)
    assert expected in message, message


@pytest.mark.parametrize("doc, expected", [
    ({**PARAMS, "method": "tie"}, "method: unknown merge method 'tie' (did you mean 'ties'?); known: "),
    ({**PARAMS, "budgt": "10%"}, "budgt: unknown key (did you mean 'budget'?); allowed keys: "),
    ({**PARAMS, "parameters": {"densty": 0.5}}, "parameters.densty: unknown key (did you mean 'density'?)"),
    ({**PARAMS, "plan": {"strategy": "sketc"}}, "unknown plan strategy 'sketc' (did you mean 'sketch'?)"),
])
def test_params_errors_name_the_closest_choice(doc, expected):
    message = _message(lambda d: config_from_dict(d, source="params.yaml"), doc)
    assert expected in message, message


def test_no_suggestion_when_nothing_is_close():
    message = _message(lambda d: mergekit_to_params(d, source="mk.yml"), {**MERGEKIT, "merge_method": "zzzz"})
    assert "did you mean" not in message and "supported: " in message
