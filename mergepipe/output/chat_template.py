"""The output tokenizer's chat template (plan `output.chat_template`, its text): written to
`chat_template.jinja` as the bytes of the text (UTF-8, nothing added), which is where
transformers' `save_pretrained` puts a tokenizer's template and where mergekit 0.1.5's output
has it. A `chat_template` key in the output's tokenizer_config.json (copied from the base or
the tokenizer source) is removed, so that the output holds one template. Only files in the
output folder are written.
"""
from __future__ import annotations

import json
from pathlib import Path

from mergepipe.checkpoint.json_files import parse_json, read_bounded
from mergepipe.checkpoint.tokenizer_files import MAX_CONFIG_BYTES, TOKENIZER_CONFIG
from mergepipe.util.fs import hash_file

CHAT_TEMPLATE_FILE = "chat_template.jinja"


def write_chat_template(text: str, out: Path) -> dict[str, str]:
    """Write `text` as out/chat_template.jinja; {name: blake3} of the files written or rewritten."""
    written = {}
    config_path = out / TOKENIZER_CONFIG
    if config_path.is_file():
        config = parse_json(read_bounded(config_path, MAX_CONFIG_BYTES), config_path)
        if isinstance(config, dict) and "chat_template" in config:
            del config["chat_template"]
            config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
            written[TOKENIZER_CONFIG] = hash_file(config_path)
    (out / CHAT_TEMPLATE_FILE).write_bytes(text.encode("utf-8"))
    written[CHAT_TEMPLATE_FILE] = hash_file(out / CHAT_TEMPLATE_FILE)
    return written
