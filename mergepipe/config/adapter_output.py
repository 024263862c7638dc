"""`output.adapter` in params.yaml: the merge written as one PEFT LoRA adapter of the base
instead of a model (docs/design.md, "Adapters out"), and what such a config must be: every
expert an adapter, a method whose output is W0 + Σ_k c_k Δ_k for its parameters
(Method.delta_coefficients), the full budget, no plan strategy, per-tensor settings or
model-file options. Checked from the config alone, before any file is read.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import BaseModel, Field, model_validator

from mergepipe.checkpoint.lora_config import MAX_RANK
from mergepipe.methods._lora_dense import DENSE_COMBINATIONS
from mergepipe.config.fields import MODEL_CONFIG
from mergepipe.errors import ConfigError
from mergepipe.methods import METHODS

if TYPE_CHECKING:
    from mergepipe.config.models import MergeConfig


class AdapterOutput(BaseModel):
    """How the experts' adapters become one: concatenated ranks (exact), a truncated SVD of
    their weighted sum, or one of PEFT's sparsifying combinations of their dense deltas,
    truncated (methods/_lora_dense.py)."""

    model_config = MODEL_CONFIG
    combination: Literal["cat", "svd", "ties_svd", "dare_linear_svd", "dare_ties_svd", "magnitude_prune_svd"] = Field(
        "cat", description="cat: the adapters' ranks side by side (exact, rank = their sum per module); "
        "svd: each module's combined delta truncated to `rank` (error reported per module); ties_svd, "
        "dare_linear_svd, dare_ties_svd, magnitude_prune_svd: PEFT's add_weighted_adapter combinations of "
        "the dense deltas at `density`, truncated to `rank`")
    rank: Annotated[int, Field(strict=True, ge=1, le=MAX_RANK)] | None = Field(
        None, description="every combination but cat: the output rank")
    density: Annotated[float, Field(strict=True, gt=0, le=1)] | None = Field(
        None, description="ties_svd, dare_*_svd, magnitude_prune_svd: the fraction of each delta kept")
    majority_sign_method: Literal["total", "frequency"] | None = Field(
        None, description="ties_svd, dare_ties_svd: the sign election (default total)")

    @model_validator(mode="after")
    def _settings_of_the_combination(self) -> AdapterOutput:
        if self.combination != "cat" and self.rank is None:
            raise ValueError(f"combination {self.combination} needs a rank (e.g. rank: 16)")
        if self.combination == "cat" and self.rank is not None:
            raise ValueError("rank is for combination svd; cat keeps every adapter's rank (their sum per module)")
        dense = self.combination in DENSE_COMBINATIONS
        if dense and self.density is None:
            raise ValueError(f"combination {self.combination} needs a density (the fraction kept, e.g. 0.5)")
        if not dense and self.density is not None:
            raise ValueError(f"density is for ties_svd, dare_*_svd and magnitude_prune_svd, not {self.combination}")
        if self.majority_sign_method is not None and DENSE_COMBINATIONS.get(self.combination, ("",))[-1] != "ties":
            raise ValueError(f"majority_sign_method is for ties_svd and dare_ties_svd, not {self.combination}")
        return self

    @property
    def seeded(self) -> bool:
        """Whether the output follows params.yaml's seed (DARE's masks)."""
        return self.combination in DENSE_COMBINATIONS and DENSE_COMBINATIONS[self.combination][0] == "random"

    def normalized(self) -> dict:
        out = {"combination": self.combination, "rank": self.rank}
        if self.combination in DENSE_COMBINATIONS:
            out["density"] = self.density
            if DENSE_COMBINATIONS[self.combination][1] == "ties":
                out["majority_sign_method"] = self.majority_sign_method or "total"
        return out


# output keys that shape model files, with what they would need
_MODEL_ONLY = {"shard_bytes": "an adapter is one file", "tokenizer_source": "an adapter has no tokenizer files",
               "tokens": "an adapter does not change the vocabulary",
               "pad_to_multiple_of": "an adapter does not change the vocabulary"}


def check_adapter_output(cfg: MergeConfig) -> dict[str, float]:
    """Each expert's coefficient c_k (the output is W0 + Σ_k c_k Δ_k), by name.

    Raises:
        ConfigError: one line naming the key: an expert that is not an adapter, a method (or
        parameters) whose output is not of that form, a budget below full, a plan strategy,
        per-tensor settings, or an output key for model files.
    """
    where = f"{cfg.source}: output.adapter"
    dense = [e.name for e in cfg.experts if e.adapter is None]
    if dense:
        raise ConfigError(f"{where}: expert {dense[0]!r} is a model folder (path:); an adapter output "
                          "combines adapters only: list every expert as adapter:, or write a model")
    method = METHODS[cfg.method]
    if method.delta_coefficients is None:
        linear = ", ".join(n for n in sorted(METHODS) if METHODS[n].delta_coefficients is not None)
        raise ConfigError(f"{where}: method {cfg.method!r} is not linear in the experts' deltas, so its merge is "
                          f"not one adapter; use {linear}, or write a model")
    if cfg.per_tensor:
        raise ConfigError(f"{where}: per-tensor settings (weight, parameters) are not supported for an adapter "
                          "output; give scalars, or write a model")
    if str(cfg.budget) != "full":
        raise ConfigError(f"{where}: budget {cfg.budget}: an adapter output reads only the adapters (every "
                          "byte of them, a few MB), never the base's weights; set budget: full")
    if cfg.plan:
        raise ConfigError(f"{where}: plan: a plan strategy chooses blocks to read under a budget; an adapter "
                          "output reads the adapters whole: remove plan")
    for key, why in _MODEL_ONLY.items():
        if getattr(cfg.output, key) is not None:
            raise ConfigError(f"{where}: output.{key} is for model outputs ({why}); remove it")
    params = cfg.method_params.model_dump(mode="json", by_alias=True)
    try:
        return method.delta_coefficients(params, {e.name: float(e.weight) for e in cfg.experts})
    except ValueError as e:
        raise ConfigError(f"{where}: method {cfg.method!r}: {e}; its merge is not one adapter") from None
