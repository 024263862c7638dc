#!/usr/bin/env python3
"""Regenerate schemas/manifest.schema.json: the JSON Schema of manifest.json (schema 2), of a
merged model or of an adapter (kind peft-lora-adapter: adapters out, extract-lora).

The manifest's own fields are written here, as docs/design.md ("Outputs and manifest",
"Adapters out", "LoRA extraction") lists them (output/manifest.py::build_manifest,
output/adapter_out.py and output/extracted_adapter.py write them); a model manifest's `plan`
and `inputs` are the plan record's schema, generated from mergepipe.plan.record.PlanRecord (the one source of what
a plan holds, as `merge` and `verify --replay` check it). A schema checks the shape only:
hashes are checked by `mergepipe verify` or scripts/check_manifest.py.

Usage: python scripts/gen_manifest_schema.py [--check]
  --check  exit 1 without writing if the committed schema is stale (for CI).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mergepipe.plan.record import PlanRecord

SCHEMA_PATH = Path(__file__).resolve().parent.parent / "schemas" / "manifest.schema.json"
HASH = {"type": "string", "pattern": "^[0-9a-f]{64}$"}
COUNT = {"type": "integer", "minimum": 0}
COUNTS = {"type": "object", "additionalProperties": COUNT}
INPUT = {"$ref": "#/$defs/PlanInputRecord"}
BASE_INPUT = {"$ref": "#/$defs/BaseInputRecord"}  # the plan's base: its copied files too
FILE_NAME = "^(?!\\.{1,2}$)[^/\\\\]+$"  # a plain file name of the folder's top level


def _obj(required: dict, optional: dict | None = None, **extra) -> dict:
    return {"type": "object", "additionalProperties": False, "required": sorted(required),
            "properties": {**required, **(optional or {})}, **extra}


def manifest_schema() -> dict:
    plan = PlanRecord.model_json_schema(by_alias=True, ref_template="#/$defs/{model}")
    defs = plan.pop("$defs")
    link = _obj({"manifest_hash": HASH, "output_hash": HASH},
                description="An input that is a mergepipe output: its manifest_hash, and blake3 of the "
                            "canonical JSON of its outputs.tensors")
    weight_file = _obj({"tree": HASH, "size": COUNT}, description="A *.safetensors file: its block hash tree")
    links = {"type": "object", "minProperties": 1, "additionalProperties": link}
    other_file = _obj({"blake3": HASH}, {"size": COUNT}, description="Any other file: blake3 of its bytes")
    byte_counts = {k: COUNT for k in ("planned_expert_bytes", "total_expert_bytes", "expert_bytes_read",
                                      "base_bytes_read", "base_bytes_copied", "bytes_written")}
    byte_counts |= {k: COUNTS for k in ("planned_by_expert", "skipped_identical_by_expert",
                                        "expert_bytes_read_by_expert")}
    model = _obj({
            "schema": {"const": 2},
            "versions": _obj({k: {"type": "string"} for k in ("mergepipe", "torch", "safetensors")}),
            "plan_hash": HASH,
            "plan": {"$ref": "#/$defs/Plan"},
            "inputs": _obj({"base": BASE_INPUT, "experts": {"type": "array", "minItems": 1, "items": INPUT}}),
            "budget": _obj({"spec": {"type": "string"}, "bytes": COUNT}),
            "bytes": _obj(byte_counts, {"planned_sketch_bytes": COUNT, "sketch_bytes_read": COUNT}),
            "bound": {"$ref": "#/$defs/BoundRecord"},
            "outputs": _obj({
                "files": {"type": "object", "minProperties": 1, "propertyNames": {"pattern": FILE_NAME},
                          "additionalProperties": {"oneOf": [weight_file, other_file]}},
                "tensors": {"type": "object", "additionalProperties": HASH},
            }),
            "manifest_hash": HASH,
        }, {"lineage": _obj({}, {"base": link, "experts": links}, minProperties=1)},
        description="A merged model (docs/design.md, 'Outputs and manifest')")
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "urn:mergepipe:manifest:2",
        "title": "mergepipe manifest.json, schema 2",
        "description": "What a merge read, computed and wrote (docs/design.md, 'Outputs and manifest'), or an "
                       "adapter mergepipe wrote (kind peft-lora-adapter: 'Adapters out', 'LoRA extraction'). "
                       "manifest_hash = blake3 of the canonical JSON of every other field.",
        "oneOf": [{"$ref": "#/$defs/ModelManifest"}, {"$ref": "#/$defs/AdapterMergeManifest"},
                  {"$ref": "#/$defs/ExtractedAdapterManifest"}],
        "$defs": {"Plan": plan, **defs, "ModelManifest": model, **adapter_manifests(other_file)},
    }


def adapter_manifests(other_file: dict) -> dict:
    """The two adapter manifests (output/adapter_out.py, output/extracted_adapter.py): recipe and
    inputs by kind of adapter; no plan, every output file and tensor by plain blake3."""
    from mergepipe.config.adapter_output import AdapterOutput
    from mergepipe.methods import METHODS
    from mergepipe.output.adapter_out import ADAPTER_KIND
    common = {
        "schema": {"const": 2}, "kind": {"const": ADAPTER_KIND},
        "versions": _obj({k: {"type": "string"} for k in ("mergepipe", "torch", "safetensors")}),
        "recipe_hash": HASH, "manifest_hash": HASH,
        "outputs": _obj({
            "files": {"type": "object", "minProperties": 2, "propertyNames": {"pattern": FILE_NAME},
                      "required": ["adapter_config.json", "adapter_model.safetensors"],
                      "additionalProperties": other_file},
            "tensors": {"type": "object", "minProperties": 1, "additionalProperties": HASH}}),
    }
    name = {"type": "string", "minLength": 1}
    scalar = {"type": ["number", "boolean", "string", "null"]}
    linear = sorted(n for n, m in METHODS.items() if m.delta_coefficients is not None)
    merge_recipe = _obj({
        "method": {"enum": linear},
        "parameters": {"type": "object", "additionalProperties": scalar},
        "adapter": AdapterOutput.model_json_schema(),
        "dtype": {"enum": [None, "float32", "bfloat16", "float16"]},
        "nonfinite": {"enum": ["error", "allow"]},
        "experts": {"type": "array", "minItems": 1, "items": _obj(
            {"name": name, "weight": {"type": "number"}, "coefficient": {"type": "number"}})},
    }, {"seed": COUNT}, description="How the adapters were combined; seed only for dare_* combinations")
    merge_inputs = _obj({
        "base": _obj({"path": name, "tensor_table": HASH}),
        "experts": {"type": "array", "minItems": 1, "items": _obj(
            {"name": name, "adapter": name, "config_blake3": HASH, "weights_blake3": HASH})},
    })
    model_ref = _obj({"path": name, "tensor_table": HASH, "tensors_blake3": HASH})
    rank_rule = {"oneOf": [_obj({"rank": {"type": "integer", "minimum": 1}}),
                           _obj({"energy": {"type": "number", "exclusiveMinimum": 0, "maximum": 1}})]}
    extract_recipe = _obj({"extract": _obj({
        "format": {"type": "integer", "minimum": 1}, "rank_rule": rank_rule, "embed_lora": {"type": "boolean"},
        "modules_to_save": {"type": "array", "items": {"type": "string"}}})})
    return {
        "AdapterMergeManifest": _obj({**common, "recipe": merge_recipe, "inputs": merge_inputs},
                                     description="Adapters out: the merge written as one PEFT LoRA adapter"),
        "ExtractedAdapterManifest": _obj({**common, "recipe": extract_recipe,
                                          "inputs": _obj({"base": model_ref, "expert": model_ref})},
                                         description="extract-lora: a dense fine-tune as a PEFT LoRA adapter"),
    }


def render() -> str:
    return json.dumps(manifest_schema(), indent=1, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="fail if the schema file is stale instead of writing it")
    args = parser.parse_args(argv)
    text = render()
    current = SCHEMA_PATH.read_text(encoding="utf-8") if SCHEMA_PATH.exists() else None
    if args.check:
        if current != text:
            print(f"{SCHEMA_PATH}: stale; run python scripts/gen_manifest_schema.py", file=sys.stderr)
            return 1
        return 0
    if current != text:
        SCHEMA_PATH.write_text(text, encoding="utf-8")
        print(f"wrote {SCHEMA_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
