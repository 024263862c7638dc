"""Untrusted JSON files (tokenizer and adapter configs through checkpoint/json_files.parse_json,
manifests through strict_loads): a duplicate key is named in one short line however long the key."""
from __future__ import annotations

import pytest

from mergepipe.checkpoint.json_files import parse_json, strict_loads
from mergepipe.errors import ConfigError
from mergepipe.units import MAX_QUOTE_CHARS

KEY = "w" * 5_000_000


def test_a_huge_duplicate_key_is_quoted_bounded_by_parse_json(tmp_path):
    """A tokenizer.json with a 5 MB token listed twice gave a 5 MB error line."""
    data = ('{"model": {"vocab": {"%s": 8, "%s": 9}}}' % (KEY, KEY)).encode()
    with pytest.raises(ConfigError) as e:
        parse_json(data, tmp_path / "tokenizer.json")
    message = str(e.value)
    assert "duplicate key 'www" in message and len(message) < len(str(tmp_path)) + MAX_QUOTE_CHARS + 100


def test_strict_loads_names_a_duplicate_key_bounded():
    with pytest.raises(ValueError, match="duplicate key 'www") as e:
        strict_loads('{"files": {"%s": 1, "%s": 2}}' % (KEY, KEY))
    assert len(str(e.value)) < MAX_QUOTE_CHARS + 50
