"""The output's tokenizer and config.json in a rebuilt vocabulary (docs/design.md,
"Vocabularies"): the tokenizer files already copied into the output (the base's, or the
tokenizer source's) get the plan's added tokens appended, with their new ids, as mergekit's
tokenizer `add_tokens` writes them (tokenizer.json `added_tokens`; tokenizer_config.json
`added_tokens_decoder` where the file has one); config.json's `vocab_size` becomes the
written embeddings' rows. Only files in the output folder are rewritten.
"""
from __future__ import annotations

import json
from pathlib import Path

from mergepipe.checkpoint.json_files import parse_json, read_bounded
from mergepipe.checkpoint.tokenizer_files import MAX_CONFIG_BYTES, MAX_TOKENIZER_BYTES, TOKENIZER_CONFIG, TOKENIZER_JSON
from mergepipe.util.fs import hash_file

_ENTRY_KEYS = ("id", "content", "single_word", "lstrip", "rstrip", "normalized", "special")


def _dump(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _set_vocab_size(config: dict, rows: int) -> None:
    """vocab_size where the config has it (text_config's for a multimodal model), else at the top."""
    nodes = [n for n in (config, config.get("text_config")) if isinstance(n, dict) and "vocab_size" in n]
    for node in nodes or [config]:
        node["vocab_size"] = rows


def write_vocabulary_files(record: dict, out: Path) -> dict[str, str]:
    """Rewrite out's tokenizer.json, tokenizer_config.json and config.json for the plan's
    `output.vocabulary` `record`; {name: blake3} of the files rewritten."""
    written = {}
    added = [{k: e[k] for k in _ENTRY_KEYS} for e in record["added"]]
    tok_path = out / TOKENIZER_JSON
    if added and tok_path.is_file():
        tok = parse_json(read_bounded(tok_path, MAX_TOKENIZER_BYTES), tok_path)
        tok["added_tokens"] = [*tok.get("added_tokens", []), *added]
        _dump(tok_path, tok)
        written[TOKENIZER_JSON] = hash_file(tok_path)
    config_path = out / TOKENIZER_CONFIG
    if added and config_path.is_file():
        config = parse_json(read_bounded(config_path, MAX_CONFIG_BYTES), config_path)
        if isinstance(config.get("added_tokens_decoder"), dict):
            for e in added:
                config["added_tokens_decoder"][str(e["id"])] = {k: e[k] for k in _ENTRY_KEYS if k != "id"}
            _dump(config_path, config)
            written[TOKENIZER_CONFIG] = hash_file(config_path)
    model_config = out / "config.json"
    if model_config.is_file():
        config = parse_json(read_bounded(model_config, MAX_CONFIG_BYTES), model_config)
        _set_vocab_size(config, record["rows"])
        model_config.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        written["config.json"] = hash_file(model_config)
    return written
