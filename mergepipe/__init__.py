"""mergepipe: budget-aware, reproducible weight-space merging of LLM checkpoints."""

# The one place the version is written (pyproject.toml reads it from here): a constant, not
# importlib.metadata, whose import and distribution scan cost ~50 ms in every command.
__version__ = "0.1.0"
