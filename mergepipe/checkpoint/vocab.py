"""A model seen in the merge's output vocabulary: a virtual checkpoint (docs/design.md,
"Vocabularies").

Its vocabulary tensors (checkpoint/blocks.py `is_vocabulary_tensor`: embed_tokens, lm_head,
...) have the output vocabulary's rows, row i made as checkpoint/vocab_map.py says: the
model's own row for token i, a donor model's row, zero, a mean of donors' rows (summed in the
tensor's dtype in model order, then divided, as mergekit does), or, for padding rows, the mean
of the view's rows 0..n-1 (a fixed-order fp64 mean, within an ulp of mergekit's torch.mean;
the one place a whole vocabulary tensor is held in memory, once per tensor, and only with
pad_to_multiple_of). Every other
tensor is the model's bytes at its own file offsets. The vocabulary tensors live in a virtual
file (a path that does not exist: what opens it by path fails loudly) read only through
VocabReader, which CheckpointReader opens for this checkpoint. torch is imported only where
a mean is made.
"""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field, replace
from itertools import groupby
from pathlib import Path
from typing import ClassVar

from blake3 import blake3

from mergepipe.checkpoint.blocks import is_vocabulary_tensor
from mergepipe.checkpoint.safetensors import (Checkpoint, CheckpointReader, ReadCounter, TensorInfo, as_tensor,
                                              tensor_bytes)
from mergepipe.checkpoint.tensor_table import TensorTable, subset
from mergepipe.checkpoint.vocab_map import VOCAB_FORMAT, Vocabulary
from mergepipe.errors import CheckpointError

VIRTUAL_SUFFIX = ".vocabulary-view"


def vocabulary_rows(ckpt: Checkpoint) -> int | None:
    """The rows of the model's vocabulary tensors (None: it has none).

    Raises:
        CheckpointError: two vocabulary tensors with different row counts.
    """
    rows = {name: shape[0] for name, shape in zip(ckpt.tensors.names, ckpt.tensors.shapes)
            if is_vocabulary_tensor(name, shape)}
    first = next(iter(rows.items()), None)
    for name, n in rows.items():
        if n != first[1]:
            raise CheckpointError(f"{ckpt.root}: vocabulary tensors {first[0]!r} ({first[1]} rows) and {name!r} "
                                  f"({n} rows) differ in size")
    return None if first is None else first[1]


class VocabReader(CheckpointReader):
    """Reads of a VocabCheckpoint: its files' bytes, and its vocabulary tensors' rows made from
    the model's and its donors' rows (uncounted readers of theirs); counted as the bytes
    returned, like a dense model's."""

    ckpt: VocabCheckpoint

    def __init__(self, ckpt: VocabCheckpoint, *, counter: ReadCounter | None = None,
                 random_access: bool = True) -> None:
        super().__init__(ckpt, counter=counter, random_access=random_access)
        self._random = random_access
        self._models: dict[str, CheckpointReader] = {}
        self._lock = threading.Lock()  # readers are shared by the engine's pool threads

    def close(self) -> None:
        for r in self._models.values():
            r.close()
        self._models.clear()
        super().close()

    def _reader(self, model: str) -> CheckpointReader:
        with self._lock:
            if model not in self._models:
                self._models[model] = CheckpointReader(self.ckpt.donors[model], counter=ReadCounter(),
                                                       random_access=self._random)
            return self._models[model]

    def read_range(self, t: TensorInfo, begin: int, end: int) -> bytearray | memoryview:
        if t.file != self.ckpt.virtual_file:
            return super().read_range(t, begin, end)
        out = bytearray(end - begin)
        for v in self.ckpt.virtual_tensors(begin, end):
            rb = v.row_bytes()
            lo, hi = max(begin, v.begin), min(end, v.end)
            r0, r1 = (lo - v.begin) // rb, -(-(hi - v.begin) // rb)
            rows = memoryview(self.rows(v.name, r0, r1)).cast("B")
            a = v.begin + r0 * rb
            out[lo - begin:hi - begin] = rows[lo - a:hi - a]
        self.counter.add(t.file, len(out))
        return out

    def model_rows(self, model: str, name: str, rows: list[int]) -> bytearray:
        """Rows `rows` of tensor `name` of model `model` (its own file), one read per run."""
        t = self.ckpt.donors[model].tensors[name]
        rb, out = t.row_bytes(), bytearray()
        reader = self._reader(model)
        for _, run in groupby(enumerate(rows), lambda kv: kv[1] - kv[0]):
            run = [r for _, r in run]
            out += reader.read_range(t, t.begin + run[0] * rb, t.begin + (run[-1] + 1) * rb)
        return out

    def rows(self, name: str, r0: int, r1: int) -> bytearray:
        """Rows r0:r1 of vocabulary tensor `name` as this view holds them."""
        ck = self.ckpt
        vocab, own = ck.vocab, ck.vocab.own[ck.name]
        n = len(vocab.tokens)
        t = ck.tensors[name]
        rb = t.row_bytes()
        out = bytearray((r1 - r0) * rb)
        kinds = [("own" if own[j] >= 0 else "fill") if j < n else "pad" for j in range(r0, r1)]
        j = r0
        for kind, run in groupby(kinds):
            k = j + len(list(run))
            if kind == "own":
                out[(j - r0) * rb:(k - r0) * rb] = self.model_rows(ck.name, name, list(own[j:k]))
            elif kind == "pad":
                row = ck.pad_row(self, name)
                for i in range(j, k):
                    out[(i - r0) * rb:(i - r0 + 1) * rb] = row
            else:
                for i in range(j, k):
                    out[(i - r0) * rb:(i - r0 + 1) * rb] = self.filled(name, vocab.fill[i], t)
            j = k
        return out

    def filled(self, name: str, fill: tuple, t: TensorInfo) -> bytes | bytearray | memoryview:
        """One row filled by rule `fill` (checkpoint/vocab_map.py)."""
        if fill[0] == "zero":
            return bytes(t.row_bytes())
        if fill[0] == "row":
            return self.model_rows(fill[1], name, [fill[2]])
        rows = [as_tensor(self.model_rows(m, name, [r]), t.dtype, t.shape[1:]) for m, r in fill[1]]
        import torch
        acc = torch.zeros(t.shape[1:], dtype=rows[0].dtype)
        for row in rows:  # mergekit's order of operations: a sum in the dtype, then one division
            acc = acc + row
        acc /= len(rows)
        return tensor_bytes(acc)


@dataclass(frozen=True, slots=True)
class VocabCheckpoint(Checkpoint):
    """Model `name` (`inner`) in vocabulary `vocab`: `files` are its files, `tensors` its tensors
    with the vocabulary tensors moved to `virtual_file`. `donors`: every model's own checkpoint by
    name (the rows it lacks come from them). `identity` names the bytes: blake3 over
    (VOCAB_FORMAT, the vocabulary's digest, the name, every model's content hash)."""

    reader_class: ClassVar[type] = VocabReader
    inner: Checkpoint = field(repr=False)
    name: str
    vocab: Vocabulary = field(repr=False)
    donors: dict[str, Checkpoint] = field(repr=False)
    identity: str
    virtual_file: Path
    _virtual: list[TensorInfo] = field(repr=False)
    _pad: dict[str, bytes] = field(repr=False, default_factory=dict)
    _pad_lock: threading.Lock = field(repr=False, default_factory=threading.Lock)

    def virtual_tensors(self, begin: int, end: int) -> list[TensorInfo]:
        return [v for v in self._virtual if v.begin < end and v.end > begin]

    def pad_row(self, reader: VocabReader, name: str) -> bytes:
        """The padding row of tensor `name`: the mean of the view's rows 0..n-1, summed in fp64
        row by row in id order (elementwise adds: the same bits on every CPU, where torch.mean's
        reduction order is the library's), divided, rounded to fp32 and then to the dtype;
        mergekit's torch.mean is within an ulp of it."""
        with self._pad_lock:
            if name not in self._pad:
                t = self.tensors[name]
                n = len(self.vocab.tokens)
                rows = as_tensor(reader.rows(name, 0, n), t.dtype, (n, *t.shape[1:]))
                import numpy as np
                import torch
                values = rows.reshape(n, -1).double().numpy()
                acc = np.zeros(values.shape[1], np.float64)
                for row in values:  # one elementwise add per row, in id order
                    np.add(acc, row, out=acc)
                mean = torch.from_numpy(acc / n).float().reshape(rows.shape[1:]).to(rows.dtype)
                self._pad[name] = bytes(tensor_bytes(mean))
            return self._pad[name]


def open_view(name: str, vocab: Vocabulary, donors: dict[str, Checkpoint],
              content_hashes: dict[str, str] | None = None) -> Checkpoint:
    """Model `name` of `donors` in vocabulary `vocab`: the model's own checkpoint where every
    row is its own (`Vocabulary.is_identity`), else a VocabCheckpoint. `content_hashes`: every
    model's content hash, for the view's identity (None: not cached, `check` reads headers only).

    Raises:
        CheckpointError: a vocabulary tensor that a donor lacks or has in another dtype or width.
    """
    inner = donors[name]
    rows = vocabulary_rows(inner)
    if rows is None or vocab.is_identity(name, rows):
        return inner
    needed = {f[1] for f in vocab.fill.values() if f[0] == "row"} | \
        {m for f in vocab.fill.values() if f[0] == "mean" for m, _ in f[1]}
    table = inner.tensors
    names, dtypes, shapes, begins, ends = list(table.names), list(table.dtypes), list(table.shapes), \
        list(table.begins), list(table.ends)
    files = list(table.files())
    virtual_file = inner.root / f"{name}-{vocab.digest[:16]}{VIRTUAL_SUFFIX}"
    offset, virtual = 0, []
    for i, (tname, shape) in enumerate(zip(names, shapes)):
        if not is_vocabulary_tensor(tname, shape):
            continue
        for m in needed:
            d = donors[m].tensors.get(tname)
            if d is None or d.dtype != dtypes[i] or tuple(d.shape[1:]) != tuple(shape[1:]):
                what = "lacks it" if d is None else f"has it as {d.dtype} {list(d.shape)}"
                raise CheckpointError(f"{donors[m].root}: tensor {tname!r}: model {m!r} gives rows of it to "
                                      f"{name!r} ({dtypes[i]} {list(shape)}) but {what}")
        shapes[i] = (vocab.rows, *shape[1:])
        size = vocab.rows * (ends[i] - begins[i]) // max(1, shape[0])
        begins[i], ends[i], files[i] = offset, offset + size, virtual_file
        offset += size
        virtual.append(TensorInfo(tname, dtypes[i], shapes[i], virtual_file, begins[i], ends[i]))
    runs = [(f, i) for i, f in enumerate(files) if i == 0 or f != files[i - 1]]
    identity = "" if content_hashes is None else blake3(json.dumps(
        {"format": VOCAB_FORMAT, "vocabulary": vocab.digest, "model": name,
         "content": dict(sorted(content_hashes.items()))}, sort_keys=True).encode()).hexdigest()
    view = TensorTable(names, dtypes, shapes, begins, ends, runs)
    # each file's tensors as the view has them (an output mirroring the base's shards takes these)
    headers = tuple(replace(h, table=subset(view, h.table.names)) for h in inner.files)
    return VocabCheckpoint(inner.root, headers, view, inner, name, vocab, donors, identity, virtual_file, virtual)


@dataclass(frozen=True, slots=True)
class VocabularyViews:
    """Every model of a merge in one vocabulary: `donors` (each model's own checkpoint) and their
    content hashes, by name ("base", then the experts')."""

    vocab: Vocabulary
    donors: dict[str, Checkpoint]
    content_hashes: dict[str, str] | None = None

    def of(self, name: str) -> ModelView:
        return ModelView(self, name)


@dataclass(frozen=True, slots=True)
class ModelView:
    """One model of a VocabularyViews: what index/store.open_model opens instead of its folder."""

    views: VocabularyViews
    name: str

    def open(self) -> Checkpoint:
        v = self.views
        return open_view(self.name, v.vocab, v.donors, v.content_hashes)
