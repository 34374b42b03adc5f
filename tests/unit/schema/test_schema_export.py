"""The checked-in JSON Schemas (docs/schema/) are what ``pdserve schema`` writes today, and every wire
type of ``pdserve.protocol`` is in them: a change to a wire type that forgets the schema fails here."""

from __future__ import annotations

import argparse
import inspect
import json
from pathlib import Path

import msgspec
from pydantic import BaseModel

from pdserve.protocol import derender, engine, errors, generate, kv, openai
from pdserve.schema import render_schemas, run_schema
from pdserve.schema.export import DEFAULT_DIR

PROTOCOL_MODULES = (generate, openai, derender, errors)


def test_checked_in_schemas_match_a_fresh_export() -> None:
    fresh = render_schemas()
    on_disk = {p.name: p.read_text() for p in DEFAULT_DIR.glob("*.json")}
    assert sorted(on_disk) == sorted(fresh), "docs/schema/ has other files than `pdserve schema` writes"
    stale = [name for name, text in fresh.items() if on_disk[name] != text]
    assert not stale, f"docs/schema/ is out of date for {stale}: run `pdserve schema`"


def _names_in(schema: dict) -> set[str]:
    return {schema.get("title", "")} | set(schema.get("$defs", {}))


def test_every_http_wire_type_is_exported() -> None:
    exported = set().union(*(_names_in(json.loads(text)) for text in render_schemas().values()))
    wire_types = {
        name
        for module in PROTOCOL_MODULES
        for name, obj in vars(module).items()
        if inspect.isclass(obj)
        and issubclass(obj, BaseModel)
        and obj.__module__ == module.__name__
        and not obj.__subclasses__()  # bases (OpenAIModel, SamplingRequest, *Base) are not sent as such
    }
    missing = sorted(wire_types - exported)
    assert not missing, f"wire types without a schema: {missing}"


def test_every_engine_struct_is_exported() -> None:
    defs = set(json.loads(render_schemas()["engine.json"])["$defs"])
    structs = {
        name
        for name, obj in vars(engine).items()
        if inspect.isclass(obj) and issubclass(obj, msgspec.Struct) and obj.__module__ == engine.__name__
    }
    assert structs <= defs, f"engine structs without a schema: {sorted(structs - defs)}"
    # The KV structs the engine info carries come along as $defs.
    referenced = {name for name, obj in vars(kv).items() if inspect.isclass(obj) and issubclass(obj, msgspec.Struct)}
    assert defs - structs <= referenced


def test_schema_command_writes_the_files(tmp_path: Path) -> None:
    (tmp_path / "Gone.json").write_text("{}")
    assert run_schema(argparse.Namespace(out=tmp_path)) == 0
    assert {p.name for p in tmp_path.glob("*.json")} == set(render_schemas())
    request = json.loads((tmp_path / "GenerateRequest.json").read_text())
    assert {"token_ids", "sampling_params", "output_mode"} <= set(request["properties"])
