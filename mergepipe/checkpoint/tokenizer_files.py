"""A model folder's vocabulary from its tokenizer files: token -> id, and the added tokens.

Reads tokenizer.json (the model's vocabulary and `added_tokens`), tokenizer_config.json
(`added_tokens_decoder`, when present) and config.json (`vocab_size`) as untrusted JSON:
bounded sizes, duplicate keys refused, regular files only. Never a pickle, a sentencepiece
model or any code: a folder without tokenizer.json has no vocabulary here. No weight I/O.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from blake3 import blake3

from mergepipe.checkpoint.json_files import parse_json, read_bounded
from mergepipe.errors import ConfigError

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
MAX_TOKENIZER_BYTES = 256 << 20  # the largest published tokenizer.json files are ~35 MB
MAX_CONFIG_BYTES = 16 << 20
# An added token's attributes as tokenizer.json writes them (tokenizers' AddedToken)
ADDED_FLAGS = ("single_word", "lstrip", "rstrip", "normalized", "special")
_VOCAB_MODELS = ("BPE", "WordLevel", "WordPiece", "Unigram")


@dataclass(frozen=True, slots=True)
class TokenizerVocab:
    """One model's vocabulary. `ids`: every token (model vocabulary and added tokens) -> id;
    `added`: the added tokens' tokenizer.json entries by content, in id order; `limit`: ids
    below it have an embedding row (config.json `vocab_size`, else the embedding's rows);
    `files`: blake3 of each file read, so a plan can record what it was made from."""

    folder: Path
    ids: dict[str, int]
    added: dict[str, dict]
    limit: int
    files: dict[str, str]

    def valid(self) -> dict[str, int]:
        """The tokens whose ids have an embedding row (mergekit's stripped vocabulary)."""
        return {t: i for t, i in self.ids.items() if i < self.limit}


def _is_id(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**31


def config_vocab_size(folder: Path) -> int | None:
    """config.json's `vocab_size` (text_config's for a multimodal model), or None."""
    path = folder / "config.json"
    if not path.is_file():
        return None
    config = parse_json(read_bounded(path, MAX_CONFIG_BYTES), path)
    for node in (config, config.get("text_config")):
        if isinstance(node, dict) and _is_id(node.get("vocab_size")):
            return node["vocab_size"]
    return None


def _model_vocab(model: object, path: Path) -> dict[str, int]:
    if not isinstance(model, dict) or model.get("type") not in _VOCAB_MODELS:
        kind = model.get("type") if isinstance(model, dict) else None
        raise ConfigError(f"{path}: model.type {kind!r}: a vocabulary is read from {', '.join(_VOCAB_MODELS)} "
                          "tokenizers only")
    vocab = model.get("vocab")
    if model["type"] == "Unigram":  # [[piece, score], ...]: the id is the position
        if not isinstance(vocab, list) or not all(isinstance(p, list) and p and isinstance(p[0], str) for p in vocab):
            raise ConfigError(f"{path}: model.vocab must be a list of [piece, score] for a Unigram tokenizer")
        ids = {}
        for i, p in enumerate(vocab):
            ids.setdefault(p[0], i)
        return ids
    if not isinstance(vocab, dict) or not all(_is_id(i) for i in vocab.values()):
        raise ConfigError(f"{path}: model.vocab must map tokens to non-negative integer ids")
    return dict(vocab)


def _added_entry(entry: object, path: Path, where: str) -> dict:
    if not isinstance(entry, dict) or not isinstance(entry.get("content"), str) or not _is_id(entry.get("id")):
        raise ConfigError(f"{path}: {where}: an added token needs a string content and an integer id")
    for flag in ADDED_FLAGS:
        if not isinstance(entry.get(flag, False), bool):
            raise ConfigError(f"{path}: {where}.{flag}: must be true or false")
    return {"id": entry["id"], "content": entry["content"],
            **{flag: bool(entry.get(flag, flag == "normalized" and not entry.get("special", False)))
               for flag in ADDED_FLAGS}}


def read_vocab(folder: Path, *, rows: int) -> TokenizerVocab:
    """The vocabulary of the model in `folder`, whose embedding has `rows` rows.

    Raises:
        ConfigError: no tokenizer.json, a malformed tokenizer file, two tokens with one id, or a
        config.json vocab_size above the embedding's rows.
    """
    path = folder / TOKENIZER_JSON
    if not path.is_file():
        raise ConfigError(f"{folder}: no {TOKENIZER_JSON}; a vocabulary is read from tokenizer.json only "
                          "(a sentencepiece tokenizer.model or a slow tokenizer is not read): save the "
                          "tokenizer with a fast tokenizer (save_pretrained)")
    data = read_bounded(path, MAX_TOKENIZER_BYTES)
    files = {TOKENIZER_JSON: blake3(data).hexdigest()}
    tok = parse_json(data, path)
    ids = _model_vocab(tok.get("model"), path)
    added: dict[str, dict] = {}
    entries = tok.get("added_tokens", [])
    if not isinstance(entries, list):
        raise ConfigError(f"{path}: added_tokens must be a list")
    for i, entry in enumerate(entries):
        e = _added_entry(entry, path, f"added_tokens[{i}]")
        added.setdefault(e["content"], e)
    config_path = folder / TOKENIZER_CONFIG
    if config_path.is_file():
        raw = read_bounded(config_path, MAX_CONFIG_BYTES)
        files[TOKENIZER_CONFIG] = blake3(raw).hexdigest()
        decoder = parse_json(raw, config_path).get("added_tokens_decoder") or {}
        if not isinstance(decoder, dict):
            raise ConfigError(f"{config_path}: added_tokens_decoder must be a mapping")
        for key, entry in decoder.items():
            if not isinstance(entry, dict) or not key.isdigit():
                raise ConfigError(f"{config_path}: added_tokens_decoder[{key!r}]: an id and its token")
            e = _added_entry({**entry, "id": int(key)}, config_path, f"added_tokens_decoder[{key!r}]")
            added.setdefault(e["content"], e)
    for content, e in added.items():
        ids.setdefault(content, e["id"])
    by_id: dict[int, str] = {}
    for token, i in ids.items():
        if by_id.setdefault(i, token) != token:
            raise ConfigError(f"{path}: tokens {by_id[i]!r} and {token!r} both have id {i}")
    limit = config_vocab_size(folder)
    if limit is not None and limit > rows:
        raise ConfigError(f"{folder / 'config.json'}: vocab_size {limit}, but the embedding has {rows} rows")
    added = dict(sorted(added.items(), key=lambda kv: kv[1]["id"]))
    return TokenizerVocab(folder, ids, added, rows if limit is None else limit, files)
