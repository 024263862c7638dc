"""The output vocabulary of a merge and, for each model, where each of its rows comes from
(docs/design.md, "Vocabularies"): mergekit 0.1.5's rules, from tokenizer files alone.

Output vocabulary:
- `base`: the base's tokens whose ids have an embedding row;
- `union`: those, then every other model's plain (not added) tokens the base lacks, then every
  model's added tokens (the first model's attributes win), models in order base, experts;
- a model folder: that folder's tokenizer;
then each `tokens:` key not in it, added. Ids run 0..n-1; `pad_to_multiple_of` rounds the row
count up.
Rows of model m, output token t: m's own row for t when m has it (id below its vocab_size) and
t is not forced; else the token's rule (`tokens:`: a model's row for t, a model's row for
another token or id, zero), else by default: the only model that has t, zero when none does,
the base's row, or the mean of the rows of the models that have t (summed in the tensor's
dtype, in model order, then divided). Padding rows: the mean of the model's own rows 0..n-1.
Pure: no weight I/O (checkpoint/vocab.py makes the rows).
"""
from __future__ import annotations

import json
from array import array
from dataclasses import dataclass, field

from blake3 import blake3

from mergepipe.checkpoint.tokenizer_files import TokenizerVocab
from mergepipe.errors import ConfigError

VOCAB_FORMAT = 1  # bump when a view's rows change meaning (the rules above)
BASE = "base"
_PLAIN_ADDED = {"single_word": False, "lstrip": False, "rstrip": False, "normalized": True, "special": False}


@dataclass(frozen=True, slots=True)
class TokenRule:
    """A `tokens:` entry: `kind` "model" (model's row for this token), "model_token" (model's
    row for `token` or `token_id`), or "zero"; `force`: every model takes it, not only those
    lacking the token."""

    kind: str
    model: str | None = None
    token_id: int | None = None
    token: str | None = None
    force: bool = False


# A filled row: ("row", model, row) | ("mean", ((model, row), ...)) | ("zero",) | ("pad",)
Fill = tuple


@dataclass(frozen=True, slots=True)
class Vocabulary:
    """`tokens`: output id -> token; `rows`: the output's embedding rows (padded); `added`: the
    tokenizer.json entries added to the source tokenizer, with their new ids; `own[m]`: model
    m's row for each output token (-1: it lacks the token, or the token is forced); `fill`:
    output id -> the row a model whose own[m] is -1 takes; `digest` names all of it."""

    source: str
    models: tuple[str, ...]
    tokens: list[str] = field(repr=False)
    rows: int
    added: list[dict] = field(repr=False)
    own: dict[str, array] = field(repr=False)
    fill: dict[int, Fill] = field(repr=False)
    digest: str = ""

    def is_identity(self, model: str, rows: int) -> bool:
        """Whether model m's rows are its own, in order, and all of them (no view needed)."""
        own = self.own[model]
        return rows == self.rows == len(own) and not self.fill and own == array("q", range(rows))

    def rule_of(self, i: int) -> str:
        """How output token i is filled where a model lacks it, in words (the plan's record)."""
        f = self.fill[i]
        if f[0] == "row":
            return f"{f[1]} row {f[2]}"
        if f[0] == "mean":
            return "mean of " + ", ".join(m for m, _ in f[1])
        return f[0]


def _contiguous(ids: dict[str, int], what: str) -> list[str]:
    tokens = sorted(ids, key=ids.__getitem__)
    if [ids[t] for t in tokens] != list(range(len(tokens))):
        missing = next(i for i, t in enumerate(tokens) if ids[t] != i)
        raise ConfigError(f"{what}: token ids are not 0..{len(tokens) - 1} (no token has id {missing}); an output "
                          "vocabulary must be contiguous")
    return tokens


def output_tokens(source: str, vocabs: dict[str, TokenizerVocab], source_vocab: TokenizerVocab | None,
                  extra: list[str]) -> tuple[list[str], list[dict]]:
    """The output's tokens by id, and the added-token entries appended to the source tokenizer."""
    base = vocabs[BASE]
    if source_vocab is not None:
        tokens = _contiguous(source_vocab.ids, f"{source_vocab.folder}/tokenizer.json")
    else:
        tokens = _contiguous(base.valid(), f"{base.folder}/tokenizer.json")
    have = set(tokens)
    added: list[dict] = []

    def add(token: str, entry: dict) -> None:
        if token not in have:
            have.add(token)
            added.append({**entry, "id": len(tokens), "content": token})
            tokens.append(token)
    if source == "union":
        for v in vocabs.values():
            for token, i in sorted(v.valid().items(), key=lambda kv: kv[1]):
                if token not in v.added and not any(token in w.added for w in vocabs.values()):
                    add(token, _PLAIN_ADDED)
        for v in vocabs.values():
            for token, entry in v.added.items():
                if entry["id"] < v.limit:
                    add(token, {k: entry[k] for k in ("single_word", "lstrip", "rstrip", "normalized", "special")})
    for token in extra:
        add(token, _PLAIN_ADDED)
    return tokens, added


def _rule_fill(token: str, rule: TokenRule, tokens_of: dict[str, dict[str, int]], rows_of: dict[str, int],
               own: dict[str, array], i: int) -> Fill:
    where = f"output.tokens[{token!r}]"
    if rule.kind == "zero":
        return ("zero",)
    if rule.model not in own:
        raise ConfigError(f"{where}.source: no model {rule.model!r}; name the base ('base') or an expert "
                          f"({', '.join(m for m in own if m != BASE)})")
    if rule.kind == "model":
        if own[rule.model][i] < 0:
            raise ConfigError(f"{where}.source: model {rule.model!r} has no token {token!r}; give a token or "
                              "token_id of its vocabulary")
        return ("row", rule.model, own[rule.model][i])
    if rule.token is not None:
        if rule.token not in tokens_of[rule.model]:
            raise ConfigError(f"{where}.source.token: model {rule.model!r} has no token {rule.token!r}")
        return ("row", rule.model, tokens_of[rule.model][rule.token])
    if not 0 <= rule.token_id < rows_of[rule.model]:
        raise ConfigError(f"{where}.source.token_id: {rule.token_id} is out of range for model {rule.model!r} "
                          f"({rows_of[rule.model]} embedding rows)")
    return ("row", rule.model, rule.token_id)


def build_vocabulary(source: str, vocabs: dict[str, TokenizerVocab], rows_of: dict[str, int], *,
                     source_vocab: TokenizerVocab | None = None, rules: dict[str, TokenRule] | None = None,
                     pad_to_multiple_of: int | None = None) -> Vocabulary:
    """The output vocabulary and every model's row sources (module docstring). `vocabs` and
    `rows_of` (each model's embedding rows): by model name, the base ("base") first.

    Raises:
        ConfigError: a vocabulary whose ids are not contiguous, or a `tokens:` rule naming an
        unknown model or a token or id the model does not have.
    """
    rules = rules or {}
    tokens, added = output_tokens(source, vocabs, source_vocab, list(rules))
    tokens_of = {m: v.valid() for m, v in vocabs.items()}
    own = {m: array("q", (tokens_of[m].get(t, -1) for t in tokens)) for m in vocabs}
    fill: dict[int, Fill] = {}
    for i, token in enumerate(tokens):
        rule = rules.get(token)
        if rule is not None:
            fill[i] = _rule_fill(token, rule, tokens_of, rows_of, own, i)
            if rule.force:
                for m in own:
                    own[m][i] = -1
            elif all(own[m][i] >= 0 for m in own):
                del fill[i]
            continue
        present = [m for m in own if own[m][i] >= 0]
        if len(present) == len(own):
            continue
        if len(present) == 1:
            fill[i] = ("row", present[0], own[present[0]][i])
        elif not present:
            fill[i] = ("zero",)
        elif own[BASE][i] >= 0:
            fill[i] = ("row", BASE, own[BASE][i])
        else:
            fill[i] = ("mean", tuple((m, own[m][i]) for m in present))
    rows = len(tokens)
    if pad_to_multiple_of and rows % pad_to_multiple_of:
        rows += pad_to_multiple_of - rows % pad_to_multiple_of
    digest = blake3(json.dumps({"format": VOCAB_FORMAT, "source": source, "tokens": tokens, "rows": rows,
                                "own": {m: own[m].tobytes().hex() for m in own},
                                "fill": sorted([i, list(f)] for i, f in fill.items())},
                               separators=(",", ":"), ensure_ascii=False).encode()).hexdigest()
    return Vocabulary(source, tuple(vocabs), tokens, rows, added, own, fill, digest)
