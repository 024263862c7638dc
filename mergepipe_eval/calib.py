"""Calibration and held-out text for the SmolLM2 strategy screen (issue 12), from Debian data.

Neither text may be evaluation data. Both are drawn from the same installed Debian packages
as the tasks (`fortunes`, `wordnet-base`), but only from material no task split uses:

- English fortune files that no task reads (the tasks read TOPIC_FILES and SHUFFLE_FILES),
  minus any quote that also occurs in a task's files or in any split;
- WordNet glosses that are in no split of any task (train or test, all five tasks).

The calibration text (what `plan: {strategy: calibrated, text: ...}` reads) and the held-out
text (where KL(full merge || budgeted merge) of next-token distributions is measured) use
disjoint fortune files and disjoint glosses. Each is a deterministic interleaving of fortunes
and glosses, one item per paragraph, cut to about `target_chars` characters (SmolLM2's
tokenizer gives ~4.3 characters per token on this text, so 80k characters ~ 18k tokens;
the strategy reads the first `max_tokens` of them).
"""
from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

from mergepipe_eval.tasks import (SHUFFLE_FILES, TOPIC_FILES, _fortunes, _wordnet_synsets,
                                  read_split)

CALIB_FILES = ("art", "kids", "love", "magic", "medicine", "news", "pets", "riddles",
               "songs-poems", "sports")
HELDOUT_FILES = ("debian", "goedel", "linuxcookie", "startrek", "tao", "zippy")
SPLIT_TASKS = ("noun_cat", "verb_cat", "pos", "shuffled", "topic")


def split_texts(tasks_root: Path) -> set[str]:
    """Every text of every split (train and test) of every task under tasks_root."""
    out: set[str] = set()
    for task in SPLIT_TASKS:
        d = tasks_root / task
        for split in ("train", "test"):
            texts, _, _ = read_split(d, split)
            out.update(texts)
    return out


def _norm(s: str) -> str:
    return " ".join(s.lower().split())


def build(tasks_root: Path, *, target_chars: int = 80_000, seed: int = 0) -> dict[str, str]:
    """{"calib": text, "heldout": text}; raises if either overlaps a split."""
    used = split_texts(tasks_root)
    used_norm = {_norm(t) for t in used}
    task_quotes = {_norm(q) for name in (*TOPIC_FILES, *SHUFFLE_FILES) for q in _fortunes(name)}
    banned = used_norm | task_quotes
    glosses = sorted({d for pos in ("noun", "verb", "adj", "adv") for _, _, d in _wordnet_synsets(pos)
                      if _norm(d) not in banned and len(d) >= 20})
    rng = random.Random(f"calib:{seed}")
    rng.shuffle(glosses)
    half = len(glosses) // 2
    gloss_sets = {"calib": glosses[:half], "heldout": glosses[half:]}
    out = {}
    seen_quotes: set[str] = set()
    for kind, files in (("calib", CALIB_FILES), ("heldout", HELDOUT_FILES)):
        quotes = sorted({q for name in files for q in _fortunes(name)
                         if _norm(q) not in banned and _norm(q) not in seen_quotes})
        seen_quotes |= {_norm(q) for q in quotes}
        rng.shuffle(quotes)
        items, size, gi = [], 0, 0
        for q in quotes:  # one fortune, then two glosses, until the target size
            for item in (q, *gloss_sets[kind][gi:gi + 2]):
                items.append(item)
                size += len(item) + 2
            gi += 2
            if size >= target_chars:
                break
        out[kind] = "\n\n".join(items) + "\n"
    check_disjoint(out, used)
    return out


def check_disjoint(texts: dict[str, str], used: set[str]) -> None:
    """No paragraph of either text is a split text, and the two texts share no paragraph."""
    paras = {k: {_norm(p) for p in v.split("\n\n") if p.strip()} for k, v in texts.items()}
    used_norm = {_norm(t) for t in used}
    for k, ps in paras.items():
        bad = ps & used_norm
        if bad:
            raise ValueError(f"{k} text contains {len(bad)} split texts, e.g. {sorted(bad)[0]!r}")
    both = paras["calib"] & paras["heldout"]
    if both:
        raise ValueError(f"calibration and held-out text share {len(both)} paragraphs")


def write(tasks_root: Path, out_dir: Path, **kw) -> dict:
    texts = build(tasks_root, **kw)
    out_dir.mkdir(parents=True, exist_ok=True)
    info = {"calib_files": list(CALIB_FILES), "heldout_files": list(HELDOUT_FILES),
            "split_tasks": list(SPLIT_TASKS), "overlap_with_splits": 0, "overlap_between": 0}
    for kind, text in texts.items():
        (out_dir / f"{kind}.txt").write_text(text, encoding="utf-8")
        info[kind] = {"chars": len(text), "paragraphs": text.count("\n\n") + 1,
                      "sha256": hashlib.sha256(text.encode()).hexdigest()}
    (out_dir / "texts.json").write_text(json.dumps(info, indent=1, sort_keys=True) + "\n")
    return info
