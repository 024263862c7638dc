"""The calibration pass: a factored diagonal Fisher of the base model on the user's text.

The base is loaded with transformers (fp32, eval mode: no dropout) and run over the
calibration text cut into sequences of `seq_len` tokens (at most `max_tokens` in all).
Each sequence's next-token loss is backpropagated and its squared gradient g^2 added
per tensor as row sums and column sums (fp64):

    R_i = sum_s sum_j g_sij^2,  C_j = sum_s sum_i g_sij^2,  T = sum_ij = sum_i R_i

and F_ij ~ R_i C_j / T (the rank-1 fit with the same margins), stored as rows = R/sqrt(T*S),
cols = C/sqrt(T*S) for S sequences (so rows_i * cols_j is a mean over sequences). 1-D
tensors keep their exact diagonal (rows = sum_s g^2 / S, cols = [1]). Rows carry what
single rows matter for (the embedding rows of the tokens used and predicted), columns what
input channels matter for (as AWQ's activation statistics do). Only the base is run,
never an expert.

The numbers come from torch's float kernels, so their last bits can depend on the CPU;
the plan records the artifact's hash, and a replay uses the same artifact, so a merge is
byte-reproducible given its artifact (docs/design.md, "Calibrated plans").
"""
from __future__ import annotations

import math
import time
import warnings
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from blake3 import blake3

from mergepipe.checkpoint.safetensors import FLOAT_DTYPES, Checkpoint
from mergepipe.errors import ConfigError
from mergepipe.util.progress import Progress

Importance = dict[str, tuple[np.ndarray, np.ndarray]]


def read_text(path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: calibration text not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read calibration text as UTF-8 ({e})") from None
    if not text.strip():
        raise ConfigError(f"{path}: calibration text is empty")
    return text


@contextmanager
def _hushed(quiet: bool):
    """transformers' logging at error level and Python warnings off, for this call only
    (`-q` promises no output but errors; restored after, whatever happens)."""
    if not quiet:
        yield
        return
    from transformers.utils import logging as hf_logging
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(level)


def read_calibration_text(path: Path, *, keep_chars: int) -> tuple[str, str]:
    """(the text's first `keep_chars` characters, blake3 of the whole text as read_text gives
    it), streamed: a corpus-sized file by mistake costs a read, not its size in memory.
    Same errors as read_text."""
    h, kept, seen = blake3(), [], False
    try:
        with open(path, encoding="utf-8") as f:  # universal newlines, as Path.read_text
            while chunk := f.read(1 << 20):
                h.update(chunk.encode())
                seen = seen or bool(chunk.strip())
                if sum(map(len, kept)) < keep_chars:
                    kept.append(chunk)
    except FileNotFoundError:
        raise ConfigError(f"{path}: calibration text not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read calibration text as UTF-8 ({e})") from None
    if not seen:
        raise ConfigError(f"{path}: calibration text is empty")
    return "".join(kept)[:keep_chars], h.hexdigest()


def first_tokens(tok, text: str, max_tokens: int) -> list[int]:
    """The first `max_tokens` token ids of `text`, tokenizing a growing prefix (16 characters a
    token to start) until it holds max_tokens + 64 tokens: tokenization is local, so these are
    the whole text's first tokens, and a long text is never tokenized whole. verbose=False: the
    text is longer than the model's context on purpose (cut into seq_len sequences)."""
    n = max(4096, 16 * max_tokens)
    while True:
        ids = tok(text[:n], add_special_tokens=False, verbose=False)["input_ids"]
        if n >= len(text) or len(ids) >= max_tokens + 64:
            return ids[:max_tokens]
        n *= 4


def fisher(base: Checkpoint, text: str, *, max_tokens: int, seq_len: int,
           progress: bool = False, quiet: bool = False) -> tuple[Importance, dict[str, str]]:
    """(importance per base tensor, metadata) from one pass over `text`; `quiet`: nothing of
    transformers' on stderr but errors."""
    with _hushed(quiet):
        return _fisher(base, text, max_tokens=max_tokens, seq_len=seq_len, progress=progress)


def _fisher(base: Checkpoint, text: str, *, max_tokens: int, seq_len: int,
            progress: bool) -> tuple[Importance, dict[str, str]]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()  # our own progress line, not one bar per loaded file
    root = base.root
    try:
        tok = AutoTokenizer.from_pretrained(root)
        model = AutoModelForCausalLM.from_pretrained(root, dtype=torch.float32)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds; one line for the user
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"{root}: the calibrated strategy needs the base as a transformers causal LM "
                          f"with its tokenizer: {msg}") from None
    ids = first_tokens(tok, text, max_tokens)
    seqs = [ids[i:i + seq_len] for i in range(0, len(ids), seq_len)]
    seqs = [s for s in seqs if len(s) >= 2]
    if not seqs:
        raise ConfigError(f"calibration text has {len(ids)} tokens; at least 2 are needed")
    model.eval()
    params = {n: p for n, p in model.named_parameters()}  # tied weights appear once
    covered = {n: p for n, p in params.items()
               if n in base.tensors and base.tensors[n].dtype in FLOAT_DTYPES
               and tuple(base.tensors[n].shape) == tuple(p.shape)}
    if not covered:
        raise ConfigError(f"{root}: none of the model's parameters match the checkpoint's tensor names")
    sums = {n: (torch.zeros(p.shape[0] if p.dim() else 1, dtype=torch.float64),
                torch.zeros(math.prod(p.shape[1:]) if p.dim() > 1 else 1, dtype=torch.float64))
            for n, p in covered.items()}
    t0 = time.monotonic()
    with Progress(len(seqs), "calibrating", progress, unit="seq") as prog:
        for s in seqs:
            x = torch.tensor([s])
            model.zero_grad(set_to_none=True)
            model(input_ids=x, labels=x).loss.backward()
            for n, p in covered.items():
                if p.grad is None:
                    continue
                # squared in place in fp64 (one temporary, not two: the tied embedding's gradient is
                # 28M elements per sequence); the same values as .double().square()
                g2 = p.grad.detach().to(torch.float64, copy=True).reshape(sums[n][0].numel(), -1).square_()
                sums[n][0].add_(g2.sum(dim=1))
                sums[n][1].add_(g2.sum(dim=0))
            prog.step(1)
    out: Importance = {}
    n_seq = len(seqs)
    for n, (r, c) in sums.items():
        r, c = r.numpy(), c.numpy()
        if c.size == 1:  # 1-D: the exact diagonal
            out[n] = (r / n_seq, np.ones(1))
            continue
        total = float(r.sum())
        norm = math.sqrt(total * n_seq) if total > 0 else 1.0
        out[n] = (r / norm, c / norm)
    meta = {"sequences": str(n_seq), "tokens": str(sum(len(s) for s in seqs)),
            "seconds": f"{time.monotonic() - t0:.1f}"}
    return out, meta
