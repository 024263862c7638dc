"""A user's edit to a published output's model card (or config, tokenizer files) is never lost
silently: `run` rebuilds an output whose files changed since publication, and replacing an
edited non-weight file is refused in one line naming it, unless --force."""
from __future__ import annotations

import json
from pathlib import Path

from mergepipe.cli import main
from tests.corpus.procs import params


def _family(tiny_family) -> dict:
    root = Path(tiny_family["root"])
    return {"base": root / "base", "experts": [root / f"expert_{k}" for k in range(3)]}


def test_an_edited_model_card_is_not_replaced_without_force(tiny_family, tmp_path, capsys):
    out = tmp_path / "out"
    cfg = params(tmp_path / "p.yaml", _family(tiny_family), out, tmp_path / "cache")
    assert main(["run", str(cfg), "-q"]) == 0
    card = out / "README.md"
    generated = card.read_bytes()
    mine = generated + b"\n## My notes\n\nEvaluated on our benchmark: 71.2.\n"
    card.write_bytes(mine)
    capsys.readouterr()
    assert main(["run", str(cfg), "-q"]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "README.md" in err and "--force" in err and str(out) in err
    assert card.read_bytes() == mine  # the edit is kept
    # the weights and the other files are untouched too
    assert json.loads((out / "manifest.json").read_text())["outputs"]["files"]["README.md"]
    assert main(["run", str(cfg), "-q", "--force"]) == 0
    assert card.read_bytes() == generated and main(["verify", str(out)]) == 0


def test_damaged_weights_are_still_rebuilt(tiny_family, tmp_path):
    """Weight files are mergepipe's own: a flipped byte is rebuilt without --force."""
    out = tmp_path / "out"
    cfg = params(tmp_path / "p.yaml", _family(tiny_family), out, tmp_path / "cache")
    assert main(["run", str(cfg), "-q"]) == 0
    weights = out / "model.safetensors"
    good = weights.read_bytes()
    data = bytearray(good)
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    assert main(["run", str(cfg), "-q"]) == 0
    assert weights.read_bytes() == good
