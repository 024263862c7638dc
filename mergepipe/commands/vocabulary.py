"""The merge's output vocabulary, from a config or a plan (docs/design.md, "Vocabularies").

`config_vocabulary` builds it from the models' headers and tokenizer files (checkpoint/
tokenizer_files.py, checkpoint/vocab_map.py) when the config asks for one (`output.
tokenizer_source: union`, `output.tokens`, `output.pad_to_multiple_of`); `vocabulary_record` is
what the plan records of it (`output.vocabulary`: the recipe, the tokenizer files' hashes, the
added tokens, each filled token's rule, the digest); `plan_vocabulary` rebuilds it from a plan
and refuses tokenizer files changed since. No weight is read here.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from mergepipe.checkpoint.safetensors import Checkpoint, open_checkpoint
from mergepipe.checkpoint.tokenizer_files import TokenizerVocab, read_vocab
from mergepipe.checkpoint.vocab import VocabularyViews, open_view, vocabulary_rows
from mergepipe.checkpoint.vocab_map import BASE, TokenRule, Vocabulary, build_vocabulary
from mergepipe.errors import ConfigError, IntegrityError

_SOURCE_ROWS = 1 << 31  # a tokenizer source folder's vocabulary is taken whole (mergekit's, unstripped)


@dataclass(frozen=True, slots=True)
class Recipe:
    """What the vocabulary is made from: `source` "union", "base" or a model folder (`source_dir`,
    written as `source`), the `tokens:` rules (as normalized), `pad_to_multiple_of`, and every
    model's folder by name (the base first)."""

    source: str
    source_dir: Path | None
    tokens: dict[str, dict]
    pad_to_multiple_of: int | None
    models: dict[str, Path]


def _rule(token: str, spec: dict) -> TokenRule:
    from mergepipe.config.vocabulary import TokenConfig
    return TokenConfig.model_validate(spec).rule()


def in_content_order(recipe: Recipe, content_hashes: dict[str, str]) -> Recipe:
    """`recipe` with its experts in content-hash order (the plan's canonical order): the order
    a params.yaml lists them changes no token id and no row."""
    experts = sorted((n for n in recipe.models if n != BASE), key=lambda n: (content_hashes[n], n))
    return replace(recipe, models={BASE: recipe.models[BASE], **{n: recipe.models[n] for n in experts}})


def views(store, recipe: Recipe, block_bytes: int, *, threads: int = 2, progress: bool = False
          ) -> tuple[Recipe, Vocabulary, dict[str, TokenizerVocab], VocabularyViews]:
    """Index every model of `recipe` (cached), order its experts by content, build the vocabulary
    and every model's view of it."""
    donors, hashes = store.own_models(recipe.models, block_bytes=block_bytes, threads=threads, progress=progress)
    recipe = in_content_order(recipe, hashes)
    vocab, vocabs = build(recipe)
    return recipe, vocab, vocabs, VocabularyViews(vocab, donors, hashes)


def build(recipe: Recipe) -> tuple[Vocabulary, dict[str, TokenizerVocab]]:
    """The vocabulary of `recipe` (models in its order: the base, then the experts), and each
    model's tokenizer vocabulary.

    Raises:
        ConfigError: a model without tokenizer.json or vocabulary tensors, malformed tokenizer
        files, or a rule naming an unknown model or token.
        CheckpointError: a malformed checkpoint header.
    """
    vocabs, rows_of = {}, {}
    for name, folder in recipe.models.items():
        rows = vocabulary_rows(open_checkpoint(folder))
        if rows is None:
            raise ConfigError(f"{folder}: no vocabulary tensor (embed_tokens, lm_head, ...: [vocab, hidden]); "
                              "output.tokenizer_source union, tokens and pad_to_multiple_of rebuild embeddings")
        vocabs[name], rows_of[name] = read_vocab(folder, rows=rows), rows
    source_vocab = None if recipe.source_dir is None else read_vocab(recipe.source_dir, rows=_SOURCE_ROWS)
    rules = {t: _rule(t, spec) for t, spec in recipe.tokens.items()}
    vocab = build_vocabulary("union" if recipe.source == "union" else "model" if source_vocab else "base",
                             vocabs, rows_of, source_vocab=source_vocab, rules=rules,
                             pad_to_multiple_of=recipe.pad_to_multiple_of)
    return vocab, vocabs


def config_recipe(cfg) -> Recipe | None:
    """The vocabulary recipe of a validated config, or None when the output keeps the base's
    vocabulary: no union, tokens or padding asked for, and no `align_vocabulary` or every model
    already has the output vocabulary (its own rows, in order, all of them: nothing to rebuild)."""
    out = cfg.output
    if not out.aligns_vocabulary:
        return None
    only_align = out.tokenizer_source != "union" and out.tokens is None and out.pad_to_multiple_of is None
    folders = {BASE: cfg.base, **{e.name: e.path for e in cfg.experts if getattr(e, "adapter", None) is None}}
    norm = cfg.normalized()["output"]
    source = "union" if out.tokenizer_source == "union" else "base" if out.tokenizer_dir is None else \
        norm["tokenizer_source"]
    recipe = Recipe(source, out.tokenizer_dir, norm.get("tokens", {}), out.pad_to_multiple_of, folders)
    if only_align and _maps_to_itself(recipe):
        return None  # an adapter expert has the base's vocabulary, which is the output's here
    for e in cfg.experts:
        if getattr(e, "adapter", None) is not None:
            raise ConfigError(f"experts[{e.name!r}].adapter: a LoRA adapter has the base's vocabulary; "
                              "output.tokenizer_source union, tokens, pad_to_multiple_of and a vocabulary other "
                              "than the base's (align_vocabulary) take model folders only")
    return recipe


def _maps_to_itself(recipe: Recipe) -> bool:
    """Whether every model of `recipe` has exactly the output vocabulary's rows."""
    vocab, _ = build(recipe)
    return all(vocab.is_identity(name, vocabulary_rows(open_checkpoint(folder)))
               for name, folder in recipe.models.items())


def config_vocabulary(cfg) -> Vocabulary | None:
    recipe = config_recipe(cfg)
    return None if recipe is None else build(recipe)[0]


def vocabulary_record(recipe: Recipe, vocab: Vocabulary, vocabs: dict[str, TokenizerVocab]) -> dict:
    """The plan's `output.vocabulary`."""
    return {"source": recipe.source, "tokens": recipe.tokens, "pad_to_multiple_of": recipe.pad_to_multiple_of,
            "tokenizers": {name: dict(sorted(v.files.items())) for name, v in vocabs.items()},
            "size": len(vocab.tokens), "rows": vocab.rows, "added": vocab.added,
            "filled": [[i, vocab.tokens[i], vocab.rule_of(i)] for i in sorted(vocab.fill)],
            "digest": vocab.digest}


def plan_vocabulary(plan, root: Path, store, *, threads: int = 2) -> VocabularyViews | None:
    """Every model's view of the vocabulary a plan records, rebuilt from the same tokenizer files.

    Raises:
        IntegrityError: a tokenizer file changed since the plan was made.
    """
    record = plan.output.vocabulary  # plan/record.py VocabularyRecord
    if record is None:
        return None

    def at(path: str) -> Path:
        p = Path(path)
        return p if p.is_absolute() else root / p
    models = {BASE: at(plan.base.path), **{e.name: at(e.path) for e in plan.experts}}
    source = record.source
    recipe = Recipe(source, None if source in ("union", "base") else at(source), record.tokens,
                    record.pad_to_multiple_of, models)
    recipe, vocab, vocabs, made = views(store, recipe, plan.block_bytes, threads=threads)
    for name, v in vocabs.items():
        if dict(sorted(v.files.items())) != record.tokenizers.get(name):
            raise IntegrityError(f"{models[name]}: tokenizer files changed since the plan was made; re-plan")
    if vocab.digest != record.digest:
        raise IntegrityError(f"{recipe.source_dir or models[BASE]}: the output vocabulary is not the planned one "
                             "(a tokenizer file changed since the plan was made); re-plan")
    return made


def header_views(cfg) -> dict[str, Checkpoint] | None:
    """Each model's checkpoint as the merge sees it (headers only: `check` compares shapes),
    by name; None when the output keeps the base's vocabulary."""
    recipe = config_recipe(cfg)
    if recipe is None:
        return None
    vocab, _ = build(recipe)
    views = VocabularyViews(vocab, {name: open_checkpoint(p) for name, p in recipe.models.items()})
    return {name: open_view(name, vocab, views.donors) for name in recipe.models}
