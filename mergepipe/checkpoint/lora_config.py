"""A PEFT LoRA adapter's adapter_config.json, read as untrusted input: the facts a merge needs
(rank, alpha, rsLoRA, fan_in_fan_out, rank_pattern, alpha_pattern), each checked for type
and range, and every setting under which the merged weights are not W + scale·B·A refused by
name (DoRA and the other LoRA variants, PEFT types other than LORA, initialisations that
change the base). Settings that only shape training (dropout, target_modules, task_type, ...)
are not read. No torch, no weight files.

Patterns follow PEFT (`peft/utils/other.py::get_pattern_key`): a rank_pattern or alpha_pattern
key is a regular expression that matches a module name when the name, or its part after some
".", matches it to the end; the first key in the file's order that matches wins, else the
global r or lora_alpha applies.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from mergepipe.checkpoint.json_files import parse_json, read_bounded
from mergepipe.errors import ConfigError
from mergepipe.units import short_repr

ADAPTER_CONFIG = "adapter_config.json"
MAX_CONFIG_BYTES = 16 << 20
MAX_RANK = 1 << 16
MAX_PATTERN_CHARS = 512

# LoraConfig fields whose truthy value selects a variant whose merge is not W + scale·B·A
_VARIANTS = {"use_dora": "DoRA", "use_qalora": "QA-LoRA", "use_bdlora": "block-diagonal LoRA",
             "alora_invocation_tokens": "activated LoRA", "velora_config": "VeLoRA",
             "monteclora_config": "MonteCLoRA", "arrow_config": "Arrow", "kasa_config": "KaSA",
             "trainable_token_indices": "trainable tokens", "target_parameters": "LoRA on parameters",
             "layer_replication": "layer replication"}
# init_lora_weights values whose adapter is relative to a changed base (PiSSA, OLoRA, CorDA,
# LoftQ and LoRA-GA subtract the initial B·A from the base weights) or a variant (MiCA)
_PLAIN_INITS = (True, False, "gaussian", "eva", "orthogonal")
# a group followed by a quantifier, or a backreference: the shapes whose regex matching can
# take exponential time (patterns come from an untrusted file)
_SLOW_REGEX = re.compile(r"\)[*+?{]|\\[1-9]")


@dataclass(frozen=True, slots=True)
class Pattern:
    key: str
    regex: re.Pattern
    value: int | float


@dataclass(frozen=True, slots=True)
class LoraSettings:
    """What a merge reads of adapter_config.json."""

    r: int
    alpha: float
    rslora: bool
    fan_in_fan_out: bool
    rank_pattern: tuple[Pattern, ...] = ()
    alpha_pattern: tuple[Pattern, ...] = ()

    def rank_of(self, module: str) -> int:
        return int(_first_match(self.rank_pattern, module, self.r))

    def alpha_of(self, module: str) -> float:
        return float(_first_match(self.alpha_pattern, module, self.alpha))

    def scale_of(self, module: str) -> float:
        """PEFT's scaling: lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora (a Python
        float, as PEFT multiplies B·A by it)."""
        r, alpha = self.rank_of(module), self.alpha_of(module)
        return alpha / math.sqrt(r) if self.rslora else alpha / r


def _first_match(patterns: tuple[Pattern, ...], module: str, default: int | float) -> int | float:
    for p in patterns:
        if p.regex.match(module):
            return p.value
    return default


def read_settings(folder: Path) -> tuple[LoraSettings, bytes]:
    """The settings of `folder`'s adapter_config.json and the file's bytes (hashed into the
    adapter's identity).

    Raises:
        ConfigError: missing, unreadable, not JSON, a field of the wrong type or range, a
        PEFT type other than LORA, a LoRA variant or an initialisation that changes the base.
    """
    path = folder / ADAPTER_CONFIG
    raw = read_bounded(path, MAX_CONFIG_BYTES)
    config = parse_json(raw, path)
    return parse_settings(config, path), raw


def parse_settings(config: dict, path: Path | str) -> LoraSettings:
    """`read_settings` on the parsed JSON object (errors name `path` and the key)."""
    def fail(key: str, message: str) -> ConfigError:
        return ConfigError(f"{path}: {key}: {message}")

    peft_type = config.get("peft_type")
    if peft_type != "LORA":
        what = short_repr(peft_type) if peft_type is not None else "missing"
        raise fail("peft_type", f"{what}: only LORA adapters can be merged (VeRA, IA3, LoHa, LoKr, AdaLoRA "
                                "and other PEFT types are not supported)")
    for key, name in _VARIANTS.items():
        if config.get(key):
            raise fail(key, f"{short_repr(config[key])}: {name} is not supported; only plain LoRA "
                            "(W + scale·B·A) can be merged")
    init = config.get("init_lora_weights", True)
    if not any(init is v or (isinstance(v, str) and init == v) for v in _PLAIN_INITS):
        raise fail("init_lora_weights", f"{short_repr(init)}: an adapter initialised this way is "
                                        "relative to a changed base (PiSSA, OLoRA, CorDA, LoftQ, "
                                        "LoRA-GA) or is a variant (MiCA); save it converted to plain "
                                        "LoRA (PEFT's path_initial_model_for_weight_conversion)")
    r = _rank(config.get("r", 8), "r", fail)
    alpha = _number(config.get("lora_alpha", 8), "lora_alpha", fail)
    rslora = _flag(config, "use_rslora", fail)
    fan_in_fan_out = _flag(config, "fan_in_fan_out", fail)
    ranks = _patterns(config.get("rank_pattern"), "rank_pattern", fail, lambda v, k: _rank(v, k, fail))
    alphas = _patterns(config.get("alpha_pattern"), "alpha_pattern", fail, lambda v, k: _number(v, k, fail))
    return LoraSettings(r, alpha, rslora, fan_in_fan_out, ranks, alphas)


def _rank(value: object, key: str, fail) -> int:
    if type(value) is not int or not 0 < value <= MAX_RANK:
        raise fail(key, f"must be an integer rank in [1, {MAX_RANK}], got {short_repr(value)}")
    return value


def _number(value: object, key: str, fail) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise fail(key, f"must be a finite number, got {short_repr(value)}")
    return float(value)


def _flag(config: dict, key: str, fail) -> bool:
    value = config.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise fail(key, f"must be true or false, got {short_repr(value)}")
    return value


def _patterns(value: object, key: str, fail, check) -> tuple[Pattern, ...]:
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise fail(key, f"must be an object of module pattern -> value, got {short_repr(value)}")
    out = []
    for pattern, v in value.items():
        where = f"{key}[{short_repr(pattern)}]"
        if not pattern or len(pattern) > MAX_PATTERN_CHARS:
            raise fail(where, f"a pattern must be 1 to {MAX_PATTERN_CHARS} characters")
        if _SLOW_REGEX.search(pattern):
            raise fail(where, "a quantified group or a backreference in a pattern is refused (its matching "
                              "time is unbounded); write the module names out")
        try:
            regex = re.compile(rf"(.*\.)?({pattern})$")
        except re.error as e:
            raise fail(where, f"not a regular expression: {e}") from None
        out.append(Pattern(pattern, regex, check(v, where)))
    return tuple(out)
