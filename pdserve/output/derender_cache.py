"""Streaming ``/derender``: live per-choice states kept between chunks, bounded by count and age.

The stateless tier rebuilds a parser from the client-carried state on every chunk, replaying all
output seen so far (O(n) per chunk, O(n²) per stream). A client that sends the chunks of a stream
to the same server in order can continue from the state the previous chunk left behind instead;
this module keeps those states. It knows nothing of HTTP or of what a state holds.

A state is found by the stream it belongs to (:class:`StreamKey`: request id, choice index, a
digest of the prompt ids, the parser settings) and the output it consumed, which must equal, id for
id and chunk for chunk, what the client's state says was consumed: an RL client that resends a
request id with another prompt or other earlier output never continues another stream's state.
Comparing the lists costs about as much as a digest of them would, less than parsing them from
the request, and leaves no collision to reason about. A hit takes the state out (the caller puts
the advanced one back), so two clients that continue one state never share a live parser.
"""

from __future__ import annotations

import hashlib
import threading
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

V = TypeVar("V")

# Output ids of the position that go into the lookup key: enough to tell streams of the same request
# id and length apart without hashing the whole output (the full output is compared on a hit).
KEY_TAIL_IDS = 8
_DIGEST_BYTES = 16


def ids_digest(ids: Sequence[int]) -> bytes:
    """A digest of token ids (as 64-bit integers), e.g. of the prompt a stream continues."""
    return hashlib.blake2b(array("q", ids), digest_size=_DIGEST_BYTES).digest()


def text_digest(text: str) -> bytes:
    """A digest of text, e.g. the JSON of the request a stream's output is parsed for."""
    return hashlib.blake2b(text.encode(), digest_size=_DIGEST_BYTES).digest()


@dataclass(frozen=True, slots=True)
class StreamKey:
    """One choice of one stream: what a cached state must belong to, besides the output it consumed.

    ``settings`` is everything that changes how the output is parsed (the server's parser config,
    a digest of the request the client sent with the chunk).
    """

    request_id: str
    index: int
    prompt: bytes
    settings: Hashable


@dataclass(slots=True)
class _Entry(Generic[V]):
    value: V
    output_ids: list[int]
    chunk_lens: list[int]
    stored_at: float


class DerenderCache(Generic[V]):
    """An LRU of stream states, at most ``max_entries``, each dropped ``ttl_s`` after its last use.

    Every use takes an entry out and puts its successor back, so the insertion order is the order
    of last use and expired entries sit at the front. Counters are cumulative, for ``/metrics``.
    Thread-safe (a scrape may come from another thread than the requests).
    """

    def __init__(self, max_entries: int, ttl_s: float, clock: Callable[[], float] = time.monotonic):
        if max_entries < 0 or ttl_s <= 0:
            raise ValueError("max_entries must be 0 or more and ttl_s positive")
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: OrderedDict[tuple[StreamKey, int, int, tuple[int, ...]], _Entry[V]] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.evictions = 0  # entries dropped unused: over max_entries, expired, or replaced by a newer one

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    def _key(
        stream: StreamKey, output_ids: Sequence[int], chunk_lens: Sequence[int]
    ) -> tuple[StreamKey, int, int, tuple[int, ...]]:
        return stream, len(output_ids), len(chunk_lens), tuple(output_ids[-KEY_TAIL_IDS:])

    def take(self, stream: StreamKey, output_ids: Sequence[int], chunk_lens: Sequence[int]) -> V | None:
        """The state of ``stream`` that consumed exactly ``output_ids`` in ``chunk_lens`` chunks,
        removed from the cache; None (a miss) if there is none or it expired."""
        key = self._key(stream, output_ids, chunk_lens)
        with self._lock:
            self._expire(self._clock())
            entry = self._entries.get(key)
            # Same key but other output: another stream's state, which stays for that stream.
            if entry is None or entry.output_ids != output_ids or entry.chunk_lens != chunk_lens:
                self.misses += 1
                return None
            del self._entries[key]
            self.hits += 1
            return entry.value

    def put(self, stream: StreamKey, output_ids: list[int], chunk_lens: list[int], value: V) -> None:
        """Keep ``value``, the state of ``stream`` after ``output_ids`` (the lists are kept, not
        copied: the caller must not change them), evicting the least recently used beyond the bound."""
        if self.max_entries == 0:
            return
        key = self._key(stream, output_ids, chunk_lens)
        with self._lock:
            now = self._clock()
            self._expire(now)
            if self._entries.pop(key, None) is not None:
                self.evictions += 1
            self._entries[key] = _Entry(value, output_ids, chunk_lens, now)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
                self.evictions += 1

    def expire(self) -> None:
        """Drop the entries unused for ``ttl_s`` (also done on every take and put)."""
        with self._lock:
            self._expire(self._clock())

    def _expire(self, now: float) -> None:
        while self._entries:
            key, oldest = next(iter(self._entries.items()))
            if now - oldest.stored_at < self.ttl_s:
                return
            del self._entries[key]
            self.evictions += 1
