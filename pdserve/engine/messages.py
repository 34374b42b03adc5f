"""Typed messages: commands into a step loop, and what one step sends back.

The same structs travel two ways: through the in-process engine's thread inbox and, msgpack
encoded, between an engine core and its clients (one tagged union per direction: commands over the
core's ZMQ socket, what the core sends back over each client's output stream). A step's outcome
is one :class:`StepOutputs`, so a step costs one message and one dispatch whatever its batch.
"""

from __future__ import annotations

import msgspec

from pdserve.protocol.engine import ABORT_BY_CLIENT, EngineInfo, EngineOutput, EngineRequest, EngineStats

# -- commands (client -> step loop) -----------------------------------------------------


class AddRequest(msgspec.Struct, tag="add"):
    request: EngineRequest


class AbortRequests(msgspec.Struct, tag="abort"):
    request_ids: list[str]
    cause: str = ABORT_BY_CLIENT


class StopSequence(msgspec.Struct, tag="stop"):
    """The frontend finished one sequence itself (stop string): free it, emit nothing more for it."""

    request_id: str
    index: int


class Shutdown(msgspec.Struct, tag="shutdown"):
    """Stop the in-process engine's thread (never sent over ZMQ: a client leaves with Goodbye)."""


Command = AddRequest | AbortRequests | StopSequence


class Hello(msgspec.Struct, tag="hello"):
    """A client introduces itself; the core connects to ``outputs`` (the client's output stream,
    :mod:`pdserve.engine.output_stream`) and answers there with :class:`Ready`."""

    outputs: str


class Goodbye(msgspec.Struct, tag="bye"):
    """A client leaves: its unfinished requests are aborted."""


ClientMessage = Hello | AddRequest | AbortRequests | StopSequence | Goodbye

# -- step outcomes (step loop -> client) ------------------------------------------------


# RequestFailed.kind of a decode leg whose KV could not be pulled (--kv-load-failure-policy fail).
KV_LOAD_FAILED = "kv_load"


class RequestFailed(msgspec.Struct):
    """A request ended with an error (``dead``: the engine itself is gone; ``kind`` tells the cause)."""

    request_id: str
    message: str
    dead: bool = False
    kind: str = ""


class StepOutputs(msgspec.Struct, tag="outputs", omit_defaults=True):
    """Everything one turn of a step loop produced for one client, in order of delivery.

    ``finished`` lists requests whose streams end after ``outputs``; ``failed`` those that end
    with an error instead. ``step`` numbers the core's steps (0 until its first one).
    """

    outputs: list[EngineOutput] = msgspec.field(default_factory=list)
    finished: list[str] = msgspec.field(default_factory=list)
    failed: list[RequestFailed] = msgspec.field(default_factory=list)
    step: int = 0

    def __bool__(self) -> bool:
        return bool(self.outputs or self.finished or self.failed)


class Ready(msgspec.Struct, tag="ready"):
    info: EngineInfo
    pid: int


class Heartbeat(msgspec.Struct, tag="heartbeat"):
    stats: EngineStats


class CoreDead(msgspec.Struct, tag="dead"):
    message: str


CoreMessage = Ready | StepOutputs | Heartbeat | CoreDead
