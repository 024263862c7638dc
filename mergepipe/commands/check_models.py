"""What `mergepipe check` (commands/check.py) says about the models: each expert's tensors
against the base's (from safetensors headers), and the facts config.json and the tokenizer
files give (architectures, layer count, vocabulary). Reads those small files and nothing of
a tensor; pure otherwise: it returns lines, the caller decides what blocks.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from mergepipe.checkpoint.blocks import is_vocabulary_tensor
from mergepipe.checkpoint.safetensors import Checkpoint
from mergepipe.commands.stack import LAYER_KEYS
from mergepipe.units import format_bytes

MAX_JSON_BYTES = 256 << 20  # a tokenizer.json is tens of MiB at most; anything larger is not read
SHOWN = 3  # mismatching tensors named per kind and expert; the rest are counted


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What a model folder's config.json and tokenizer files say (None: not said)."""

    architectures: tuple[str, ...] | None
    layers: int | None
    vocab_size: int | None  # config.json
    tokens: int | None  # the tokenizer's vocabulary: its highest token id + 1
    added: int  # added tokens (tokenizer.json added_tokens, else tokenizer_config.json's)


def _json(path: Path) -> object:
    try:
        if not path.is_file() or path.stat().st_size > MAX_JSON_BYTES:
            return None
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _tokenizer(folder: Path) -> tuple[int | None, int]:
    """(highest token id + 1, added tokens) from tokenizer.json, else the added tokens of
    tokenizer_config.json (whose base vocabulary is in tokenizer.model, not read: tokens None)."""
    data = _json(folder / "tokenizer.json")
    if isinstance(data, dict):
        model = data.get("model") if isinstance(data.get("model"), dict) else {}
        vocab = model.get("vocab")
        ids = [i for i in map(_int, vocab.values()) if i is not None] if isinstance(vocab, dict) else \
            list(range(len(vocab))) if isinstance(vocab, list) else []
        added = [_int(t.get("id")) for t in data.get("added_tokens") or [] if isinstance(t, dict)]
        added = [i for i in added if i is not None]
        top = max([*ids, *added], default=None)
        known = set(ids)
        return (None if top is None else top + 1), sum(i not in known for i in added)
    config = _json(folder / "tokenizer_config.json")
    decoder = config.get("added_tokens_decoder") if isinstance(config, dict) else None
    return None, len(decoder) if isinstance(decoder, dict) else 0


def read_facts(folder: Path) -> ModelFacts:
    config = _json(folder / "config.json")
    nodes = [n for n in (config, config.get("text_config") if isinstance(config, dict) else None)
             if isinstance(n, dict)]
    archs = next((a for n in nodes if isinstance(a := n.get("architectures"), list)
                  and all(isinstance(x, str) for x in a)), None)
    layers = next((v for n in nodes for k in LAYER_KEYS if (v := _int(n.get(k))) is not None), None)
    vocab = next((v for n in nodes if (v := _int(n.get("vocab_size"))) is not None), None)
    tokens, added = _tokenizer(folder)
    return ModelFacts(None if archs is None else tuple(archs), layers, vocab, tokens, added)


def describe(ckpt: Checkpoint, facts: ModelFacts) -> str:
    """`21 tensors, 12.3 MiB BF16, LlamaForCausalLM, 4 layers, 32000 tokens` (what is known)."""
    dtypes = sorted({t.dtype for t in ckpt.tensors.values()})
    parts = [f"{len(ckpt.tensors)} tensors", f"{format_bytes(ckpt.total_bytes)} {'/'.join(dtypes)}"]
    if facts.architectures:
        parts.append(",".join(facts.architectures))
    if facts.layers is not None:
        parts.append(f"{facts.layers} layers")
    if facts.tokens is not None:
        parts.append(f"{facts.tokens} tokens" + (f" ({facts.added} added)" if facts.added else ""))
    return ", ".join(parts)


def _counted(items: list[str]) -> str:
    more = f" (+{len(items) - SHOWN} more)" if len(items) > SHOWN else ""
    return ", ".join(items[:SHOWN]) + more


def tensor_mismatches(base: Checkpoint, expert: Checkpoint) -> list[str]:
    """One line per kind of difference between an expert's tensors and the base's: missing
    and extra tensors, a vocabulary size (the first dimension of embed_tokens, lm_head, ...:
    checkpoint/blocks.is_vocabulary_tensor) named as such, other shapes and dtypes named with
    the tensor and both; [] when names, shapes and dtypes all match."""
    tb, te = base.tensors, expert.tensors
    if tb.names == te.names and tb.dtypes == te.dtypes and tb.shapes == te.shapes:  # C speed, the usual case
        return []
    b = dict(zip(base.tensors.names, zip(base.tensors.dtypes, base.tensors.shapes)))
    e = dict(zip(expert.tensors.names, zip(expert.tensors.dtypes, expert.tensors.shapes)))
    if b == e:  # the same tensors in another order (another sharding)
        return []
    lines = []
    missing = sorted(b.keys() - e.keys())
    if missing:
        lines.append(f"{len(missing)} tensor(s) of the base missing: {_counted([repr(n) for n in missing])}")
    extra = sorted(e.keys() - b.keys())
    if extra:
        lines.append(f"{len(extra)} tensor(s) not in the base: {_counted([repr(n) for n in extra])}")
    shapes = []
    for name in sorted(b.keys() & e.keys()):
        (b_dtype, b_shape), (e_dtype, e_shape) = b[name], e[name]
        if (b_dtype, b_shape) == (e_dtype, e_shape):
            continue
        if b_shape[1:] == e_shape[1:] and len(b_shape) == 2 and b_shape[0] != e_shape[0] and \
                (is_vocabulary_tensor(name, b_shape) or is_vocabulary_tensor(name, e_shape)):
            lines.append(f"vocabulary size {e_shape[0]}, the base {b_shape[0]} ({name!r} has {e_shape[0]} "
                         f"rows, the base {b_shape[0]}): mergepipe does not remap embeddings to another "
                         "vocabulary; merge experts of the base's tokenizer")
            continue
        shapes.append(f"{name!r} is {e_dtype}{list(e_shape)}, the base {b_dtype}{list(b_shape)}")
    if shapes:
        lines.append(f"{len(shapes)} tensor(s) differ in shape or dtype: {_counted(shapes)}")
    return lines


def fact_differences(name: str, base: ModelFacts, expert: ModelFacts, *, base_rows: int | None,
                     tokenizer_from: str) -> list[str]:
    """Lines on config.json and tokenizer facts that differ from the base's. `base_rows`: the
    base's embedding rows (None: no vocabulary tensor); `tokenizer_from`: whose tokenizer the
    output gets ("the base's", or output.tokenizer_source's)."""
    lines = []
    if base.architectures and expert.architectures and base.architectures != expert.architectures:
        lines.append(f"expert {name!r}: architectures {','.join(expert.architectures)}, the base "
                     f"{','.join(base.architectures)} (config.json)")
    if base.layers is not None and expert.layers is not None and base.layers != expert.layers:
        lines.append(f"expert {name!r}: {expert.layers} layers, the base {base.layers} (config.json)")
    if base.vocab_size is not None and expert.vocab_size is not None and base.vocab_size != expert.vocab_size:
        lines.append(f"expert {name!r}: vocab_size {expert.vocab_size}, the base {base.vocab_size} "
                     "(config.json)")
    if base.tokens is not None and expert.tokens is not None and base.tokens != expert.tokens:
        rows = "" if base_rows is None else (
            f"; the embedding rows match ({base_rows}), so they merge row by row" if
            max(base.tokens, expert.tokens) <= base_rows else f"; the base has {base_rows} embedding rows")
        added = f" ({expert.added} added)" if expert.added else ""
        lines.append(f"expert {name!r}: tokenizer of {expert.tokens} tokens{added}, the base's {base.tokens}"
                     f"{rows}; the output gets {tokenizer_from} tokenizer")
    return lines
