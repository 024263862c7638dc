"""`mergepipe demo`'s options, apart from the demo (commands/demo.py) so that the CLI, which
builds every subcommand's parser at start, does not import torch. tests/test_cli_help.py
checks that the names here are demo.py's presets and dtypes."""
from __future__ import annotations

import argparse

DESCRIPTION = "Write a seeded demo family: base + experts."
PRESET_NAMES = ("bench", "bench3b", "small", "tiny")
DTYPE_NAMES = ("bfloat16", "float16", "float32")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's options, on its own parser and on `mergepipe demo`'s."""
    parser.add_argument("out", help="folder to write base/ and expert_*/ into")
    parser.add_argument("--preset", choices=PRESET_NAMES, default="tiny",
                        help="model shapes: tiny and small (Llama layout, seconds to make), bench "
                        "(Qwen2.5-0.5B's), bench3b (Qwen2.5-3B's) (default %(default)s)")
    parser.add_argument("--experts", type=int, default=3, help="number of experts K (default %(default)s)")
    parser.add_argument("--dtype", choices=DTYPE_NAMES, default="bfloat16",
                        help="dtype of every tensor (default %(default)s)")
    parser.add_argument("--tied", action=argparse.BooleanOptionalAction, default=None,
                        help="tie lm_head to the embeddings (default: the preset's choice)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the family: same arguments, same bytes (default %(default)s)")
    parser.add_argument("--quiet", "-q", action="store_true", help="no progress and no list of the folders written")
