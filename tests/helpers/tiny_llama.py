"""A tiny Llama family for the `calibrated` strategy's tests: a real decoder that transformers
runs on CPU in a second, its calibration text, and the params.yaml that merges it."""
from __future__ import annotations

from pathlib import Path

import torch
import yaml

WORDS = "the cat dog sat on a mat ran far away and then slept in sun rain".split()


def tiny_llama(root: Path) -> Path:
    """A random-init 2-layer Llama with a word-level tokenizer at root/base, and two experts
    (root/expert_0, expert_1: the base plus seeded noise of two sizes)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    vocab = {"<unk>": 0, **{w: i + 1 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                      max_position_embeddings=128)
    model = LlamaForCausalLM(cfg)
    base = root / "base"
    model.save_pretrained(base, safe_serialization=True)
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(base)
    for k, scale in enumerate([0.05, 0.02]):
        g = torch.Generator().manual_seed(k + 1)
        with torch.no_grad():
            expert = LlamaForCausalLM(cfg)
            expert.load_state_dict(model.state_dict())
            for p in expert.parameters():
                p.add_(scale * torch.randn(p.shape, generator=g))
        expert.save_pretrained(root / f"expert_{k}", safe_serialization=True)
    return root


def calibrated_config(tmp: Path, root: Path, budget: str, **plan) -> Path:
    """A params.yaml merging the tiny Llama's two experts with plan strategy calibrated."""
    cfg = {"base": str(root / "base"),
           "experts": [{"name": "a", "path": str(root / "expert_0"), "weight": 1.0},
                       {"name": "b", "path": str(root / "expert_1"), "weight": 1.0}],
           "method": "task_arithmetic", "parameters": {"lambda": 0.5}, "budget": budget,
           "block_bytes": "4KiB", "output": {"dir": str(tmp / f"out-{budget.rstrip('%')}"),
                                             "dtype": "float32"},
           "cache_dir": str(root / "cache"),
           "plan": {"strategy": "calibrated", "text": "calib.txt", "max_tokens": 512, "seq_len": 64, **plan}}
    path = root / f"params-{tmp.name}-{budget.rstrip('%')}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path
