"""Per-request objects still alive, for ``/metrics``: a request state or parser that something keeps
referencing after its request ended (a leak) shows as a gauge that does not return to 0.

Weak sets: counting never keeps an object alive, and an object leaves the count when it is freed.
"""

from __future__ import annotations

import weakref
from typing import Any, TypeVar

T = TypeVar("T")

request_states: weakref.WeakSet[Any] = weakref.WeakSet()
parsers: weakref.WeakSet[Any] = weakref.WeakSet()


def tracked(live: weakref.WeakSet[Any], obj: T) -> T:
    live.add(obj)
    return obj
