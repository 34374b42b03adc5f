"""Every bound pdserve puts on what one client request may hold, in one place.

A request is small on the wire and must stay small in the server: each list, string and nesting
level a client controls is bounded here, so no request can make the server allocate or compute in
proportion to a number the client made up (a choice index of 1,000,000, 10k nesting levels, a
megabyte request id). Each bound is refused with a 4xx naming the field; docs/reliability.md lists
them with the commands that show it. The field types below carry the bounds into the wire models.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, Field

# JSON nesting of a request body (objects and arrays). Tool parameter schemas nest a few levels;
# 10k levels would exhaust the parser's recursion instead.
MAX_JSON_DEPTH = 64
# All request header bytes together (request line included): a 431 past it.
MAX_HEADER_BYTES = 64 * 1024
# A client's request id (an OpenAI request's ``request_id``, or the ``X-Request-Id`` header): echoed
# back in every answer. A generate request's id may be longer by the prefixes pdserve's render adds
# (``chatcmpl-``, ``cmpl-...-N``), so that a rendered request always passes generate.
MAX_REQUEST_ID_CHARS = 256
MAX_GENERATE_REQUEST_ID_CHARS = MAX_REQUEST_ID_CHARS + 64
# ``cache_salt``: vLLM wants a non-empty string; it is hashed, never needed long.
MAX_CACHE_SALT_CHARS = 1024
# One request may not fan out into more sequences than this (vLLM's VLLM_MAX_N_SEQUENCES); generate
# choice indexes are below it.
MAX_N = 256
# Stop strings: each is matched against the new text at every step.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
# Token-id lists inside sampling params (stop_token_ids; allowed_token_ids and logit_bias are bounded by
# the vocabulary they must fit in).
MAX_STOP_TOKEN_IDS = 1024
# bad_words entries: each is tokenized before the sequences they become are capped (vLLM: 128), so bound the work.
MAX_BAD_WORDS = 1024
# A chat request's messages, tools and documents.
MAX_MESSAGES = 4096
MAX_TOOLS = 512
MAX_DOCUMENTS = 512
# Prompts of one completions request (each becomes its own engine request), and generate responses
# of one completions derender call.
MAX_PROMPTS = 1024
# Request ids of one abort call.
MAX_ABORT_IDS = 4096

# Field types carrying the bounds (ids are never negative; a negative one is a client error, not an IndexError).
TokenId = Annotated[int, Field(ge=0)]
RequestId = Annotated[str, Field(max_length=MAX_REQUEST_ID_CHARS)]
GenerateRequestId = Annotated[str, Field(max_length=MAX_GENERATE_REQUEST_ID_CHARS)]
CacheSalt = Annotated[str, Field(min_length=1, max_length=MAX_CACHE_SALT_CHARS)]
ChoiceIndex = Annotated[int, Field(ge=0, lt=MAX_N)]
StopString = Annotated[str, Field(max_length=MAX_STOP_STRING_CHARS)]

# The integers the engine core's wire (msgpack) carries: int64 and uint64.
WIRE_INT_MIN, WIRE_INT_MAX = -(2**63), 2**64 - 1


def fits_engine_wire(value: dict[str, Any]) -> dict[str, Any]:
    """Free-form JSON that travels to the engine (``extra_args``, ``kv_transfer_params``) may hold no
    integer the wire cannot carry: one would fail the engine request's encoding after validation."""
    stack: list[Any] = [value]
    while stack:  # iterative: the body check already bounds the depth, this stays flat anyway
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, int) and not WIRE_INT_MIN <= item <= WIRE_INT_MAX:
            raise ValueError(f"holds the integer {item}, outside the 64-bit range [-2**63, 2**64 - 1] "
                             "an engine request carries")
    return value


EngineJSON = Annotated[dict[str, Any], AfterValidator(fits_engine_wire)]
