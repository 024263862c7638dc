"""mergepipe: budget-aware, reproducible weight-space merging of LLM checkpoints."""
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("mergepipe")
except PackageNotFoundError:  # running from a source tree without install
    __version__ = "0.0.0+unknown"
