"""The params.yaml models: ExpertConfig, OutputConfig, MergeConfig (extra keys forbidden
everywhere), method parameters validated by the registered method's own params model,
the plan strategy's options validated by the registered strategy's own params model
(`plan:`), and the canonical `normalized()` form that plans and manifests hash.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, PrivateAttr, ValidationError, field_validator, model_validator

from mergepipe.checkpoint.blocks import DEFAULT_BLOCK_BYTES, BlockLayout
from mergepipe.config.adapter_output import AdapterOutput
from mergepipe.config.checks import (
    check_density_gamma,
    check_expert_overrides,
    check_unique_names,
    check_weight_sum,
    effective,
)
from mergepipe.config.fields import (
    DEFAULT_CACHE_DIR,
    DEFAULT_OUTPUT_DIR,
    MAX_SEED,
    MODEL_CONFIG,
    BlockBytes,
    BudgetField,
    ConfigPath,
    Name,
    OutputDtype,
    ShardBytes,
    TensorDensity,
    TensorGamma,
    TensorWeight,
)
from mergepipe.config.settings import Setting, is_setting, parse_setting
from mergepipe.config.slices import SliceConfig, check_slices, parameter_settings
from mergepipe.config.vocabulary import Tokens
from mergepipe.config.messages import describe, did_you_mean
from mergepipe.config.modules import ModuleConfig, check_modules
from mergepipe.methods import METHODS
from mergepipe.plan.strategies import DEFAULT_STRATEGY, STRATEGIES, normalized_options
from mergepipe.units import short_repr

MAX_MERGEKIT_CONFIG_CHARS = 64 << 10  # a mergekit recipe is a few KiB; the output's card quotes it whole
MAX_CHAT_TEMPLATE_CHARS = 64 << 10  # a chat template is a few KiB; the plan (and its hash) holds it whole


class ExpertConfig(BaseModel):
    """One expert checkpoint, or a PEFT LoRA adapter of the base (`adapter:`; `path` is then
    its folder too). density/gamma override the method's parameters. weight, density and
    gamma may be per-tensor settings (config/settings.py)."""

    model_config = {**MODEL_CONFIG, "json_schema_extra": {"oneOf": [{"required": ["path"]},
                                                                   {"required": ["adapter"]}]}}
    name: Name = Field(description="unique, filename-safe label (letters, digits, . _ -)")
    # no default in the schema: a validator that fills defaults (Snakemake's) would give an
    # adapter expert `path: null`, which the schema's string type refuses
    path: ConfigPath = Field(None, validate_default=False, json_schema_extra=lambda s: s.pop("default", None),
                             description="Hugging Face model folder, relative to params.yaml")
    adapter: ConfigPath | None = Field(
        None, description="instead of path: a PEFT LoRA adapter folder (adapter_config.json, "
        "adapter_model.safetensors) of the base, relative to params.yaml, or a Hugging Face id in the "
        "local cache; the expert is the base with the adapter merged in")

    @model_validator(mode="before")
    @classmethod
    def _adapter_is_its_path(cls, data: Any) -> Any:
        if isinstance(data, dict) and ("path" in data) == ("adapter" in data):
            raise ValueError("give path (a model folder) or adapter (a PEFT LoRA adapter folder)"
                             + (", not both" if "path" in data else ""))
        if isinstance(data, dict) and "adapter" in data:
            return {**data, "path": data["adapter"]}
        return data
    weight: TensorWeight = Field(description="w_k; finite, may be negative; or a per-tensor setting")
    density: TensorDensity | None = Field(None, description="per-expert density in (0, 1]")
    gamma: TensorGamma | None = Field(None, description="per-expert gamma in [0, 1) (breadcrumbs)")

    @model_validator(mode="after")
    def _density_plus_gamma(self) -> ExpertConfig:
        if isinstance(self.density, Setting) or isinstance(self.gamma, Setting):
            return self  # checked tensor by tensor when resolved (config/tensor_params.py)
        if self.density is not None and self.gamma is not None:
            check_density_gamma(self.density, self.gamma, "")
        return self


class OutputConfig(BaseModel):
    model_config = MODEL_CONFIG
    dir: ConfigPath = Field(Path(DEFAULT_OUTPUT_DIR),
                            description="output model folder, relative to params.yaml")
    dtype: OutputDtype | None = Field(
        None, description="output dtype; null keeps the base's dtypes")
    shard_bytes: ShardBytes | None = Field(
        None, description="shard size; null mirrors the base's sharding")
    tokenizer_source: Literal["union"] | ConfigPath | None = Field(
        None, description="model folder whose tokenizer files the output gets, relative to "
        "params.yaml; 'union': the base's tokenizer plus every expert's tokens, embeddings rebuilt in "
        "that vocabulary (mergekit's union); null: the base's")
    tokens: Tokens | None = Field(
        None, description="output token -> where its embedding rows come from (mergekit's tokenizer.tokens); "
        "a token not in the vocabulary is added")
    pad_to_multiple_of: Annotated[int, Field(strict=True, ge=1, le=1 << 20)] | None = Field(
        None, description="embedding rows rounded up to a multiple of this (padding rows: each model's mean row)")
    align_vocabulary: Annotated[bool, Field(strict=True)] = Field(
        False, description="rebuild every model's embeddings in the output vocabulary (the base's, or "
        "tokenizer_source's) where they differ, as mergekit's tokenizer_source base or <model> does; false: "
        "every model must have that vocabulary")
    chat_template: Annotated[str, Field(strict=True, min_length=1, max_length=MAX_CHAT_TEMPLATE_CHARS)] | None = \
        Field(None, description="the output tokenizer's chat template (Jinja text), written to chat_template.jinja "
              "(mergekit's chat_template, resolved by import-mergekit); null: the tokenizer files' own")
    adapter: AdapterOutput | None = Field(
        None, description="write the merge as one PEFT LoRA adapter of the base into output.dir (every expert an "
        "adapter, a method linear in the deltas; config/adapter_output.py); null: a model")

    @property
    def tokenizer_dir(self) -> Path | None:
        """The model folder whose tokenizer files the output gets (None: the base's, or the union)."""
        return self.tokenizer_source if isinstance(self.tokenizer_source, Path) else None

    @property
    def aligns_vocabulary(self) -> bool:
        """Whether embeddings are rebuilt in an output vocabulary (docs/design.md, "Vocabularies")."""
        return self.tokenizer_source == "union" or self.tokens is not None or self.pad_to_multiple_of is not None \
            or self.align_vocabulary
    mergekit_config: Annotated[str, Field(strict=True, max_length=MAX_MERGEKIT_CONFIG_CHARS)] | None = Field(
        None, description="the mergekit YAML this config was imported from (set by import-mergekit), as "
        "text, for the output to carry; null: not imported")


class MergeConfig(BaseModel):
    """A validated params.yaml.

    After `load_config`/`config_from_dict`, `base`, `experts[i].path`,
    `output.dir` and `cache_dir` are absolute; `normalized()` shows them as
    written. `parameters` is what the user wrote; `method_params` is the typed,
    defaults-filled parameters object of the method.
    """

    model_config = MODEL_CONFIG
    base: ConfigPath = Field(description="base model folder (W0), relative to params.yaml")
    experts: list[ExpertConfig] = Field(min_length=1, description="the experts W1..WK")
    method: Annotated[str, Field(strict=True)] = Field(description="registered merge method")
    parameters: Annotated[dict[str, Any], Field(strict=True)] = Field(
        default_factory=dict, description="method parameters (checked by the method)")
    seed: Annotated[int, Field(strict=True, ge=0, le=MAX_SEED)] = Field(
        0, description="seed for randomized methods (DARE)")
    budget: BudgetField = Field("full", validate_default=True,
                                description="most expert bytes to read: 'full', a "
                                "percentage or fraction of what a full merge reads (the "
                                "expert blocks that differ from the base), or a size")
    block_bytes: BlockBytes = Field(DEFAULT_BLOCK_BYTES, description="target block size")
    embedding_block_bytes: BlockBytes | None = Field(
        None, description="block size of vocabulary tensors (embed_tokens, lm_head, wte, word_embeddings, "
        "embed_in, embed_out, tok_embeddings; shape [vocab, hidden]), so single token rows can be read "
        "without their neighbours (default: block_bytes)")
    output: OutputConfig = Field(default_factory=OutputConfig)
    cache_dir: ConfigPath = Field(Path(DEFAULT_CACHE_DIR),
                                  description="indexes, plans and store, relative to params.yaml")
    nonfinite: Literal["error", "allow"] = Field(
        "error", description="what to do with NaN/Inf in an expert")
    plan: Annotated[dict[str, Any], Field(strict=True)] = Field(
        default_factory=dict, description="plan strategy: {strategy: NAME, ...its options} (default: "
        "sketch for task_arithmetic, linear and ties below the full budget, else energy; checked by the strategy)")
    slices: list[SliceConfig] | None = Field(
        None, description="output layer ranges merged with their own parameters and expert settings "
        "(mergekit's slices; config/slices.py); null: one set for every layer")
    modules: dict[str, ModuleConfig] | None = Field(
        None, description="parts of the model by tensor-name prefix, each merged with its own parameters "
        "and expert settings (mergekit's modules; config/modules.py); null: one set for every tensor")

    _method_params: BaseModel | None = PrivateAttr(None)
    _param_settings: dict[str, Setting] = PrivateAttr(default_factory=dict)
    _slice_settings: list[dict[str, Setting]] = PrivateAttr(default_factory=list)
    _module_settings: dict[str, dict[str, Setting]] = PrivateAttr(default_factory=dict)
    _written: dict[str, str] = PrivateAttr(default_factory=dict)
    _source: str = PrivateAttr("<dict>")
    _root: Path = PrivateAttr(default_factory=Path.cwd)  # the folder relative paths are relative to

    @field_validator("method")
    @classmethod
    def _known_method(cls, method: str) -> str:
        if method not in METHODS:
            raise ValueError(f"unknown merge method {short_repr(method)}{did_you_mean(method, METHODS)}; "
                             f"known: {', '.join(sorted(METHODS))}")
        return method

    @model_validator(mode="after")
    def _cross_checks(self) -> MergeConfig:
        check_unique_names(self.experts)
        method = METHODS[self.method]
        scalars = {k: v for k, v in self.parameters.items() if not is_setting(v)}
        try:
            params = method.params.model_validate(scalars)
        except ValidationError as err:
            raise ValueError(describe(err, method.params, ("parameters",))) from None
        self._method_params = params
        self._param_settings = self._parse_param_settings(method.params, scalars)
        if self.slices is not None:
            check_slices(self.slices, (e.name for e in self.experts))
            self._slice_settings = [self._parse_slice_settings(i, s, method.params, scalars)
                                    for i, s in enumerate(self.slices)]
        if self.modules is not None:
            if self.slices is not None:
                raise ValueError("modules: give slices or modules, not both")
            check_modules(self.modules, (e.name for e in self.experts))
            self._module_settings = {name: self._parse_part_settings(f"modules.{name}", m, method.params, scalars)
                                     for name, m in self.modules.items()}
        if method.max_experts is not None and len(self.experts) > method.max_experts:
            limit = "exactly 1 expert" if method.max_experts == 1 else \
                f"at most {method.max_experts} experts"
            raise ValueError(f"experts: method {self.method!r} takes {limit}, "
                             f"got {len(self.experts)}")
        check_expert_overrides(self.experts, self.method, method.params, params)
        check_weight_sum(self.experts, self.method, params)
        self._check_plan(method)
        return self

    def _parse_param_settings(self, params_cls: type[BaseModel], scalars: dict[str, Any]) -> dict[str, Setting]:
        """Per-tensor method parameters, each value checked by the method's params model."""
        out = {}
        for key, value in sorted(self.parameters.items()):
            if not is_setting(value):
                continue

            def check(leaf: Any, key: str = key) -> Any:
                try:
                    params_cls.model_validate({**scalars, key: leaf})
                except ValidationError as err:
                    raise ValueError(describe(err, params_cls)) from None
                return leaf
            try:
                out[key] = parse_setting(value, check)
            except ValueError as err:
                raise ValueError(f"parameters.{key}: {err}") from None
        return out

    @staticmethod
    def _parse_slice_settings(i: int, s: SliceConfig, params_cls: type[BaseModel],
                              scalars: dict[str, Any]) -> dict[str, Setting]:
        def check(key: str, leaf: Any) -> Any:
            try:
                params_cls.model_validate({**scalars, key: leaf})
            except ValidationError as err:
                raise ValueError(f"slices[{i}].parameters.{key}: {describe(err, params_cls)}") from None
            return leaf
        try:
            return parameter_settings(s, check)
        except ValueError as err:
            raise ValueError(str(err) if str(err).startswith("slices[") else f"slices[{i}].parameters: {err}") \
                from None

    @staticmethod
    def _parse_part_settings(label: str, part: ModuleConfig, params_cls: type[BaseModel],
                             scalars: dict[str, Any]) -> dict[str, Setting]:
        def check(key: str, leaf: Any) -> Any:
            try:
                params_cls.model_validate({**scalars, key: leaf})
            except ValidationError as err:
                raise ValueError(f"{label}.parameters.{key}: {describe(err, params_cls)}") from None
            return leaf
        try:
            return parameter_settings(part, check)
        except ValueError as err:
            raise ValueError(str(err) if str(err).startswith(label) else f"{label}.parameters: {err}") from None

    def _check_plan(self, method) -> None:
        name = self.plan.get("strategy", DEFAULT_STRATEGY)
        if not isinstance(name, str) or name not in STRATEGIES:
            raise ValueError(f"plan.strategy: unknown plan strategy {short_repr(name)}"
                             f"{did_you_mean(name, STRATEGIES)}; "
                             f"known: {', '.join(sorted(STRATEGIES))}")
        strategy = STRATEGIES[name]
        try:
            strategy.params.model_validate({**self.plan, "strategy": name})
        except ValidationError as err:
            raise ValueError(describe(err, strategy.params, ("plan",))) from None
        if strategy.rescales and method.cosine:
            raise ValueError(f"plan.strategy: {name!r} rescales deltas; method {self.method!r} does not "
                             "merge weighted deltas (use energy or balanced)")

    # -------------------------------------------------------- derived values

    @property
    def method_params(self) -> BaseModel:
        """The method's typed parameters, defaults filled (e.g. `.lambda_`)."""
        if self._method_params is None:  # built by model_construct, never validated
            self._method_params = METHODS[self.method].params.model_validate(self.parameters)
        return self._method_params

    @property
    def param_settings(self) -> dict[str, Setting]:
        """The method parameters given per tensor (settings), by name; {} for most configs."""
        if not self._param_settings and any(is_setting(v) for v in self.parameters.values()):
            self._param_settings = self._parse_param_settings(METHODS[self.method].params, {})
        return self._param_settings

    @property
    def slice_settings(self) -> list[dict[str, Setting]]:
        """Each slice's method parameters as settings (config/slices.py); [] without slices."""
        return self._slice_settings

    @property
    def module_settings(self) -> dict[str, dict[str, Setting]]:
        """Each module's method parameters as settings (config/modules.py); {} without modules."""
        return self._module_settings

    @property
    def source(self) -> str:
        """The file (or "<dict>") this config came from, for error messages."""
        return self._source

    def expert_density(self, expert: ExpertConfig) -> float | Setting | None:
        """The expert's density, else the method's; None if the method has none or gives
        it per tensor (then config/tensor_params.py resolves it tensor by tensor)."""
        if expert.density is None and "density" in self.param_settings:
            return None
        return effective(expert, "density", self.method_params)

    def expert_gamma(self, expert: ExpertConfig) -> float | Setting | None:
        """The expert's gamma, else the method's; None if the method has none or gives it
        per tensor."""
        if expert.gamma is None and "gamma" in self.param_settings:
            return None
        return effective(expert, "gamma", self.method_params)

    @property
    def per_tensor(self) -> bool:
        """Whether any parameter, weight, density or gamma is a per-tensor setting."""
        return bool(self.param_settings) or self.slices is not None or self.modules is not None or any(
            isinstance(getattr(e, k), Setting) for e in self.experts for k in ("weight", "density", "gamma"))

    @property
    def block_layout(self) -> BlockLayout:
        """block_bytes and, for vocabulary tensors, embedding_block_bytes (checkpoint/blocks.py)."""
        return BlockLayout(self.block_bytes, self.embedding_block_bytes)

    @property
    def plan_options(self) -> dict[str, Any] | None:
        """The plan strategy's options, normalized; None for the default strategy with
        default options (then plans carry no `strategy` key)."""
        return normalized_options(self.plan)

    def config_path(self, written: str) -> Path:
        """A path written in the config (e.g. `plan.text`), made absolute against params.yaml's folder."""
        return Path(os.path.normpath(self._root / Path(written).expanduser()))

    def normalized(self) -> dict[str, Any]:
        """Canonical JSON-able form for plan hashes and manifests.

        Defaults filled, paths as written (relative to params.yaml), budget in
        its canonical string, sizes as ints, method parameters under their
        canonical (alias) names with defaults, each expert's effective density
        and gamma. Feeding it back to `config_from_dict` gives the same form.
        """
        def written(key: str, path: Path) -> str:
            return self._written.get(key, path.as_posix())

        def shown(value: Any) -> Any:
            return value.to_json() if isinstance(value, Setting) else value

        experts = [{
            "name": e.name,
            **({"path": written(f"experts[{i}].path", e.path)} if e.adapter is None else
               {"adapter": written(f"experts[{i}].adapter", e.path)}),
            "weight": shown(e.weight),
            "density": shown(self.expert_density(e)),
            "gamma": shown(self.expert_gamma(e)),
        } for i, e in enumerate(self.experts)]
        parameters = self.method_params.model_dump(mode="json", by_alias=True)
        parameters.update({k: s.to_json() for k, s in self.param_settings.items()})
        norm = {
            "base": written("base", self.base),
            "experts": experts,
            "method": self.method,
            "parameters": parameters,
            "seed": self.seed,
            "budget": str(self.budget),
            "block_bytes": self.block_bytes,
            # only when it changes the layout, so that configs without it keep their normalized form
            **({} if self.block_layout.embedding_block_bytes is None else
               {"embedding_block_bytes": self.embedding_block_bytes}),
            "output": {
                "dir": written("output.dir", self.output.dir),
                "dtype": self.output.dtype,
                "shard_bytes": self.output.shard_bytes,
                # only when set, so that configs without it keep their normalized form
                **({} if self.output.tokenizer_dir is None else
                   {"tokenizer_source": written("output.tokenizer_source", self.output.tokenizer_dir)}),
                **({} if self.output.tokenizer_source != "union" else {"tokenizer_source": "union"}),
                **({} if self.output.tokens is None else
                   {"tokens": {t: c.model_dump(mode="json", exclude_none=True)
                               for t, c in self.output.tokens.items()}}),
                **({} if self.output.pad_to_multiple_of is None else
                   {"pad_to_multiple_of": self.output.pad_to_multiple_of}),
                **({} if not self.output.align_vocabulary else {"align_vocabulary": True}),
                **({} if self.output.chat_template is None else {"chat_template": self.output.chat_template}),
                **({} if self.output.mergekit_config is None else {"mergekit_config": self.output.mergekit_config}),
                **({} if self.output.adapter is None else {"adapter": self.output.adapter.normalized()}),
            },
            "cache_dir": written("cache_dir", self.cache_dir),
            "nonfinite": self.nonfinite,
        }
        if self.slices is not None:  # only when set, so that configs without it keep their normalized form
            norm["slices"] = [s.normalized() for s in self.slices]
        if self.modules is not None:  # only when set, so that configs without it keep their normalized form
            norm["modules"] = {name: m.normalized() for name, m in sorted(self.modules.items())}
        plan = self.plan_options
        if plan is not None:  # the default strategy adds no key (same form as before strategies)
            norm["plan"] = plan
        return norm
