"""`mergepipe provenance`: how an output was built, as an in-toto Statement v1 with a SLSA
Provenance v1 predicate (https://slsa.dev/spec/v1.0/provenance), for supply-chain tools;
written plain, or signed in the DSSE bundle of `mergepipe sign` (commands/dsse.py).

    subject               every file of the folder (manifest.json included, model.sig not), sha256
    buildDefinition
      buildType           urn:mergepipe:merge:v1 (this document's, docs/design.md "Signatures and provenance")
      externalParameters  plan_hash and the plan's settings (method, parameters, seed, budget, block
                          sizes, nonfinite, output dtype/shards, strategy name and options, per-tensor
                          settings, each expert's weight/density/gamma); the rest of the plan (reads,
                          layout, scales) is named by plan_hash and held whole by manifest.json
      resolvedDependencies  base and experts by content hash (digest `mergepipeContentHash`), path as
                          recorded, Hub URI when the path names a Hub id, lineage link when an input is
                          a merge; tokenizer-source files and the calibration text by blake3
    runDetails.builder    urn:mergepipe:cli, version = the manifest's versions; metadata.invocationId =
                          the manifest_hash. No timestamps: the same output gives the same statement.

Self-attested by whoever runs it: it says what the manifest says, in SLSA's words, and binds
it to the files' sha256; it proves nothing a replay (`verify --replay`, `audit`) does not.
"""
from __future__ import annotations

from pathlib import Path

from mergepipe.commands import dsse
from mergepipe.commands.audit_search import hub_id_of
from mergepipe.commands.sign import checked_output, file_digests
from mergepipe.errors import IntegrityError, OutputError
from mergepipe.output.adapter_out import refuse_adapter_manifest
from mergepipe.output.manifest import MANIFEST
from mergepipe.plan.record import PlanInputRecord, PlanRecord, validate_plan
from mergepipe.util.fs import atomic_write_bytes, canonical_json

SLSA_PROVENANCE = "https://slsa.dev/provenance/v1"
BUILD_TYPE = "urn:mergepipe:merge:v1"
BUILDER_ID = "urn:mergepipe:cli"
# a model's content hash (docs/design.md "Index"): sharding-independent, under the plan's block_bytes
CONTENT_HASH = "mergepipeContentHash"
SETTINGS = ("method", "parameters", "seed", "budget", "budget_bytes", "block_bytes", "embedding_block_bytes",
            "nonfinite", "tensor_parameters")


def _settings(plan: PlanRecord) -> dict:
    out = {k: getattr(plan, k) for k in SETTINGS if getattr(plan, k) is not None}
    out["output"] = {"dtype": plan.output.dtype, "shard_bytes": plan.output.shard_bytes}
    if plan.strategy is not None:
        out["strategy"] = {"name": plan.strategy.name, "parameters": plan.strategy.parameters}
    out["experts"] = {e.name: {k: getattr(e, k) for k in ("weight", "density", "gamma") if getattr(e, k) is not None}
                      for e in plan.experts}
    return out


def _model(role: str, record: PlanInputRecord, link: dict | None) -> dict:
    dep = {"name": record.name, "digest": {CONTENT_HASH: record.content_hash},
           "annotations": {"role": role, "path": record.path}}
    hub_id = hub_id_of(record.path)
    if hub_id is not None:
        dep["uri"] = f"https://huggingface.co/{hub_id}"
    if link is not None:
        dep["annotations"]["lineage"] = link  # the input is that merge's output (output/lineage.py)
    return dep


def _dependencies(man: dict, plan: PlanRecord) -> list[dict]:
    lineage = man.get("lineage") or {}
    deps = [_model("base", plan.base, lineage.get("base"))]
    deps += [_model("expert", e, (lineage.get("experts") or {}).get(e.name)) for e in plan.experts]
    tok = plan.output.tokenizer_source
    if tok is not None:
        deps += [{"name": f"tokenizer_source/{name}", "digest": {"blake3": h},
                  "annotations": {"role": "tokenizer_source", "path": tok.path}}
                 for name, h in sorted(tok.files.items())]
    calibration = plan.calibration
    if calibration is not None:
        deps.append({"name": "calibration text", "digest": {"blake3": calibration.text},
                     "annotations": {"role": "calibration"}})
    return deps


def provenance_statement(out_dir: Path, *, deep: bool = False) -> dict:
    """The SLSA provenance statement of `out_dir` (checked against its manifest first).

    Raises:
        IntegrityError: the folder does not verify, or holds a file its manifest does not record.
        ConfigError: the manifest's plan is not a plan (a key named).
    """
    man = checked_output(out_dir, deep=deep)
    refuse_adapter_manifest(man, out_dir, "provenance")
    plan = validate_plan(man.get("plan"), f"{out_dir / MANIFEST}: plan")  # the statement reads a valid plan
    digests = file_digests(out_dir)
    return {
        "_type": dsse.STATEMENT_TYPE,
        "subject": [{"name": n, "digest": {"sha256": digests[n]}} for n in sorted(digests)],
        "predicateType": SLSA_PROVENANCE,
        "predicate": {
            "buildDefinition": {
                "buildType": BUILD_TYPE,
                "externalParameters": {"plan_hash": man["plan_hash"], "plan": _settings(plan)},
                "resolvedDependencies": _dependencies(man, plan),
            },
            "runDetails": {"builder": {"id": BUILDER_ID, "version": man["versions"]},
                           "metadata": {"invocationId": man["manifest_hash"]}},
        },
    }


def write_provenance(out_dir: Path, dest: Path, *, key: Path | None = None, password_env: str | None = None,
                     force: bool = False, deep: bool = False) -> str:
    """Write the provenance statement of `out_dir` to `dest` (signed with `key` when given).
    Returns the one-line report.

    Raises:
        OutputError: `dest` is inside the folder, or exists (without `force`).
        IntegrityError: the folder does not verify. ConfigError: the key is unusable.
    """
    from mergepipe.output.safety import inside_output, refuse_inside
    if inside_output(dest, out_dir):
        raise OutputError(f"-o {dest}: inside {out_dir}, where it would be a file the manifest does not "
                          "record; write it beside the folder")
    if dest.is_dir() or (dest.exists() and not force):
        raise OutputError(f"-o {dest}: exists; refusing to overwrite it (choose another name, or pass "
                          "--force)")
    private = None if key is None else dsse.load_private_key(key, password_env=password_env)
    statement = provenance_statement(out_dir, deep=deep)
    refuse_inside(dest, _recorded_inputs(statement, out_dir))
    data = canonical_json(statement, indent=2) if private is None else dsse.sign_statement(statement, private)
    try:
        atomic_write_bytes(dest, data)
    except OSError as e:
        raise OutputError(f"-o {dest}: cannot write: {e.strerror}") from None
    how = "unsigned" if private is None else \
        f"signed with key sha256:{dsse.fingerprint(private.public_key())}"
    return f"{dest}: SLSA provenance of {len(statement['subject'])} files of {out_dir} ({how})"


def _recorded_inputs(statement: dict, out_dir: Path) -> list[Path]:
    """The input folders the manifest records, as the working directory and the output's parent
    see them (a recorded path is relative to the run's root): -o never writes into one."""
    found = []
    for dep in statement["predicate"]["buildDefinition"]["resolvedDependencies"]:
        path = dep["annotations"].get("path")
        if isinstance(path, str) and path:
            found += [p for p in (Path(path), out_dir.parent / path) if p.exists()]
    return found


def read_provenance(path: Path, trusted: list[Path]) -> tuple[dict, str]:
    """(statement, signer fingerprint) of a signed provenance bundle at `path`.

    Raises:
        IntegrityError: not signed by one of `trusted`, or not a SLSA provenance v1 statement.
    """
    opened = dsse.open_bundle(path, trusted)
    if opened.statement.get("predicateType") != SLSA_PROVENANCE:
        raise IntegrityError(f"{path}: predicateType is not {SLSA_PROVENANCE}")
    return opened.statement, opened.signer
