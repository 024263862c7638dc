"""Labelled, class-balanced, deterministic text splits from Debian's WordNet and fortunes.

Owns reading `/usr/share/wordnet/data.*` and `/usr/share/games/fortunes/*` and
writing `train.jsonl` / `test.jsonl` / `task.json` per task. No model code here.

Tasks:
- `noun_cat`: noun gloss -> one of 6 lexicographer files (noun.animal, ...).
- `verb_cat`: verb gloss -> one of 6 lexicographer files (verb.motion, ...).
- `pos`: gloss -> part of speech (noun, verb, adj, adv), from synsets the two
  tasks above did not use.
- `shuffled`: a fortune as written vs. the same fortune with its words shuffled.
- `topic`: fortune -> topic file (computers, politics, science, work).
Glosses are the definition only (examples in quotes after ';' are dropped).
"""
from __future__ import annotations

import json
import random
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

WORDNET_DIR = Path("/usr/share/wordnet")
FORTUNES_DIR = Path("/usr/share/games/fortunes")

# WordNet 3.0 lexicographer file numbers (lexnames), the ones used here.
NOUN_CLASSES = {5: "animal", 6: "artifact", 13: "food", 15: "location", 18: "person", 20: "plant"}
VERB_CLASSES = {30: "change", 32: "communication", 35: "contact", 38: "motion",
                40: "possession", 41: "social"}
TOPIC_FILES = ("computers", "politics", "science", "work")
# English fortune files for the shuffle task (disjoint from TOPIC_FILES).
SHUFFLE_FILES = ("people", "cookie", "miscellaneous", "platitudes", "wisdom", "fortunes",
                 "men-women", "humorists", "literature", "education", "law", "food")
TASKS = ("noun_cat", "verb_cat", "pos", "shuffled", "topic")


@dataclass(frozen=True, slots=True)
class Sizes:
    """Examples per class in each split (a class with fewer items is an error)."""
    train_per_class: int
    test_per_class: int


class DataMissing(RuntimeError):
    """The Debian data packages are not installed (apt-get install wordnet-base fortunes)."""


def _wordnet_synsets(pos: str) -> Iterable[tuple[str, int, str]]:
    """Yield (offset, lexicographer file number, definition) from data.<pos>."""
    path = WORDNET_DIR / f"data.{pos}"
    if not path.exists():
        raise DataMissing(f"{path} not found: apt-get install -y wordnet-base")
    with path.open(encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.startswith("  "):  # license header
                continue
            fields, _, gloss = line.partition("|")
            parts = fields.split()
            definition = gloss.split('; "')[0].strip().rstrip(";").strip()
            if definition:
                yield parts[0], int(parts[1]), definition


def _fortunes(name: str) -> list[str]:
    """Quotes of one fortune file, whitespace-normalized, overstrikes removed."""
    utf8 = FORTUNES_DIR / f"{name}.u8"
    path = utf8 if utf8.exists() else FORTUNES_DIR / name
    if not path.exists():
        raise DataMissing(f"{path} not found: apt-get install -y fortunes")
    text = path.read_text(encoding="utf-8", errors="replace")
    text = re.sub(r".\x08", "", text)
    quotes = (" ".join(q.split()) for q in re.split(r"^%$", text, flags=re.M))
    return sorted({q for q in quotes if 20 <= len(q) <= 400})


def _balanced(by_label: dict[str, list[str]], sizes: Sizes, rng_key: str,
              ) -> tuple[list[dict], list[dict]]:
    rng = random.Random(rng_key)
    need = sizes.train_per_class + sizes.test_per_class
    train, test = [], []
    for label in sorted(by_label):
        items = sorted(set(by_label[label]))
        if len(items) < need:
            raise ValueError(f"{rng_key}: class {label!r} has {len(items)} items, needs {need}")
        rng.shuffle(items)
        test += [{"text": t, "label": label} for t in items[:sizes.test_per_class]]
        train += [{"text": t, "label": label} for t in items[sizes.test_per_class:need]]
    rng.shuffle(train)
    rng.shuffle(test)
    return train, test


def _shuffle_words(text: str, rng: random.Random) -> str:
    words = text.split()
    for _ in range(10):
        rng.shuffle(words)
        out = " ".join(words)
        if out != text:
            return out
    return out


def build_task(task: str, sizes: Sizes, *, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """Return (train, test) for one task: lists of {"text", "label"}."""
    key = f"{task}:{seed}"
    if task in ("noun_cat", "verb_cat", "pos"):
        nouns = list(_wordnet_synsets("noun"))
        verbs = list(_wordnet_synsets("verb"))
        noun_tr, noun_te = _balanced(
            {name: [d for _, lex, d in nouns if lex == num] for num, name in NOUN_CLASSES.items()},
            sizes, f"noun_cat:{seed}")
        verb_tr, verb_te = _balanced(
            {name: [d for _, lex, d in verbs if lex == num] for num, name in VERB_CLASSES.items()},
            sizes, f"verb_cat:{seed}")
        if task == "noun_cat":
            return noun_tr, noun_te
        if task == "verb_cat":
            return verb_tr, verb_te
        used = {e["text"] for e in noun_tr + noun_te + verb_tr + verb_te}
        by_pos = {"noun": [d for _, _, d in nouns], "verb": [d for _, _, d in verbs],
                  "adj": [d for _, _, d in _wordnet_synsets("adj")],
                  "adv": [d for _, _, d in _wordnet_synsets("adv")]}
        return _balanced({p: [d for d in ds if d not in used] for p, ds in by_pos.items()},
                         sizes, key)
    if task == "topic":
        return _balanced({name: _fortunes(name) for name in TOPIC_FILES}, sizes, key)
    if task == "shuffled":
        pool = sorted({q for name in SHUFFLE_FILES for q in _fortunes(name)
                       if len(q.split()) >= 6})
        rng = random.Random(key)
        rng.shuffle(pool)
        half = len(pool) // 2
        shuffled = [_shuffle_words(q, rng) for q in pool[half:]]
        return _balanced({"original": pool[:half], "shuffled": shuffled}, sizes, key)
    raise ValueError(f"unknown task {task!r}; known: {', '.join(TASKS)}")


def write_task(task: str, out_dir: Path, sizes: Sizes, *, seed: int = 0) -> dict:
    """Write out_dir/{train,test}.jsonl and task.json; return the task.json content."""
    train, test = build_task(task, sizes, seed=seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", train), ("test", test)):
        with (out_dir / f"{name}.jsonl").open("w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False, sort_keys=True) + "\n")
    labels = sorted({r["label"] for r in train})
    meta = {"task": task, "labels": labels, "n_train": len(train), "n_test": len(test),
            "seed": seed, "train_per_class": sizes.train_per_class,
            "test_per_class": sizes.test_per_class}
    (out_dir / "task.json").write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")
    return meta


def read_split(task_dir: Path, split: str) -> tuple[list[str], list[int], list[str]]:
    """(texts, label ids, label names) of one split written by write_task."""
    labels = json.loads((task_dir / "task.json").read_text())["labels"]
    ids = {name: i for i, name in enumerate(labels)}
    texts, y = [], []
    with (task_dir / f"{split}.jsonl").open(encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            texts.append(row["text"])
            y.append(ids[row["label"]])
    return texts, y, labels
