"""params.yaml's `output.tokens`: where an output token's embedding rows come from
(mergekit's `tokenizer.tokens`; docs/design.md, "Vocabularies"). Typed here, applied by
checkpoint/vocab_map.py."""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field, StrictBool, StrictInt, model_validator

from mergepipe.checkpoint.vocab_map import TokenRule
from mergepipe.config.fields import MODEL_CONFIG

ModelName = Annotated[str, Field(strict=True, min_length=1, max_length=200)]
TokenText = Annotated[str, Field(strict=True, min_length=1, max_length=1000)]


class ModelTokenSource(BaseModel):
    """A model's row for another token (`token`) or id (`token_id`) of its own vocabulary."""

    model_config = MODEL_CONFIG
    kind: Literal["model_token"]
    model: ModelName = Field(description="'base' or an expert's name")
    token_id: Annotated[StrictInt, Field(ge=0)] | None = None
    token: TokenText | None = None

    @model_validator(mode="after")
    def _one_of(self) -> ModelTokenSource:
        if (self.token_id is None) == (self.token is None):
            raise ValueError("give token_id or token, not both" if self.token is not None else
                             "give token_id or token")
        return self


class ZeroSource(BaseModel):
    model_config = MODEL_CONFIG
    kind: Literal["zero"]


class TokenConfig(BaseModel):
    """One output token's rows: `source` a model's name (its row for this token), a
    model_token or zero; `force`: every model takes it, not only the models lacking the token."""

    model_config = MODEL_CONFIG
    source: ModelName | ModelTokenSource | ZeroSource = Field(
        description="'base' or an expert's name (its row for this token), {kind: model_token, model, "
        "token_id | token}, or {kind: zero}")
    force: StrictBool = Field(False, description="every model takes this row, not only those lacking the token")

    def rule(self) -> TokenRule:
        s = self.source
        if isinstance(s, str):
            return TokenRule("model", model=s, force=self.force)
        if isinstance(s, ZeroSource):
            return TokenRule("zero", force=self.force)
        return TokenRule("model_token", model=s.model, token_id=s.token_id, token=s.token, force=self.force)


Tokens = dict[TokenText, TokenConfig]
