"""Export the wire types' JSON Schemas: the pydantic HTTP types (one file each, self-contained ``$defs``)
and the msgspec engine structs (one file, ``$defs`` for every struct).

Every type is exported as pydantic validates it (fields, types, defaults). Not the serialization
schema: the messages' wrap serializers (which drop empty ``tool_calls``) hide every field from it, and
a client in another language needs the fields it may receive, all of which the validation schema lists.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import msgspec
from pydantic import TypeAdapter

from pdserve.protocol import derender, engine, errors, generate, openai

DEFAULT_DIR = Path(__file__).resolve().parents[2] / "docs" / "schema"

HTTP_TYPES: tuple[tuple[str, Any], ...] = (
    ("GenerateRequest", generate.GenerateRequest),
    ("GenerateResponse", generate.GenerateResponse),
    ("GenerateStreamResponse", generate.GenerateStreamResponse),
    ("AbortRequest", generate.AbortRequest),
    ("ErrorResponse", errors.ErrorResponse),
    ("ChatCompletionRequest", openai.ChatCompletionRequest),
    ("ChatMessageParam", openai.ChatMessageParam),  # each of messages[] (the request keeps them as dicts)
    ("ChatCompletionResponse", openai.ChatCompletionResponse),
    ("ChatCompletionStreamResponse", openai.ChatCompletionStreamResponse),
    ("CompletionRequest", openai.CompletionRequest),
    ("CompletionResponse", openai.CompletionResponse),
    ("CompletionStreamResponse", openai.CompletionStreamResponse),
    ("DerenderChatRequest", derender.DerenderChatRequest),
    ("DerenderChatStreamRequest", derender.DerenderChatStreamRequest),
    ("DerenderChatStreamResponse", derender.DerenderChatStreamResponse),
    ("DerenderCompletionRequest", derender.DerenderCompletionRequest),
    ("DerenderCompletionStreamRequest", derender.DerenderCompletionStreamRequest),
    ("DerenderCompletionStreamResponse", derender.DerenderCompletionStreamResponse),
)
ENGINE_STRUCTS: tuple[type[msgspec.Struct], ...] = (
    engine.EngineRequest,
    engine.SequenceSampling,
    engine.EngineOutput,
    engine.PositionLogprobs,
    engine.EngineInfo,
    engine.EngineStats,
)


def render_schemas() -> dict[str, str]:
    """File name -> JSON text (sorted keys, trailing newline) for every wire type."""
    files = {}
    for name, tp in HTTP_TYPES:
        schema = TypeAdapter(tp).json_schema(mode="validation")
        schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", "title": name, **schema}
        files[f"{name}.json"] = _dump(schema)
    _, components = msgspec.json.schema_components(ENGINE_STRUCTS, ref_template="#/$defs/{name}")
    files["engine.json"] = _dump(
        {
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            "title": "pdserve engine wire types (msgspec, frontend <-> engine core)",
            "$defs": components,
        }
    )
    return files


def _dump(schema: dict[str, Any]) -> str:
    return json.dumps(schema, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def write_schemas(out: Path) -> list[Path]:
    """Write every schema under ``out``, removing schema files of types that no longer exist."""
    out.mkdir(parents=True, exist_ok=True)
    files = render_schemas()
    for stale in out.glob("*.json"):
        if stale.name not in files:
            stale.unlink()
    written = []
    for name, text in files.items():
        path = out / name
        path.write_text(text)
        written.append(path)
    return written


def add_schema_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, default=DEFAULT_DIR, help=f"directory to write into (default {DEFAULT_DIR})")


def run_schema(args: argparse.Namespace) -> int:
    written = write_schemas(args.out)
    print(f"wrote {len(written)} JSON Schemas to {args.out}")
    return 0
