"""The KV hand-off as hooks of the torch step loop (``step_loop.py``): where a P/D leg differs from a
coupled request, and nowhere else.

The step loop calls the same hooks whether or not the engine runs with ``--kv-transfer``:
:class:`NoKVHandoff` (no hand-off) refuses KV requests and does nothing else, and
:class:`KVHandoffHooks` wraps a :class:`~pdserve.engine.kv.handoff.KVHandoff`. The seams, in the
order a request meets them:

* ``problems(request)``: what ``validate`` adds for ``kv_transfer_params``.
* ``on_add(req, intent)``: True when the hooks hold the request back from the scheduler: a decode leg
  waits while its KV is pulled into a slot it holds. A pull that fails applies
  ``--kv-load-failure-policy``: ``recompute`` hands the request to the scheduler to prefill here,
  ``fail`` ends it through the loop's ``fail`` callback. A prefill leg goes to the scheduler at once.
* ``poll()`` (every turn) and ``before_step()`` (every step): leases freed, pulls moved on; a pulled
  request then enters the scheduler with its slot (``ScheduledRequest.held_slot``).
* ``pulled(req)``: its KV was pulled, so admitting it computes no prompt token (the step's budget).
* ``load_prompt(req, live)``: at admission, True when the request's prompt KV was pulled (its first
  sequence is placed in the slot it landed in; siblings get copies) instead of computed.
* ``after_decode(running)``: a pulled leg's first decode step ran its last prompt token; the KV the
  prefill computed for that position is put back.
* ``on_finish(seq, finish)``: the ``kv_transfer_params`` of a finishing prefill leg (its KV exported
  under a lease), else None; a sequence that exported keeps its slot held until the lease ends.
* ``forget(req)``: the request is over; whatever the hooks hold for it is released.

Everything runs on the step loop's thread.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from pdserve.engine.kv.handoff import KVHandoff
from pdserve.engine.messages import KV_LOAD_FAILED
from pdserve.engine.models import KVCache
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.sequences import ScheduledRequest, ScheduledSequence
from pdserve.protocol.engine import EngineRequest
from pdserve.protocol.kv import KVIntent, KVStats

# The loop's way to end a request with an error: (request, message, kind).
FailRequest = Callable[[ScheduledRequest, str, str], None]

log = logging.getLogger(__name__)


class NoKVHandoff:
    """The hooks of an engine without ``--kv-transfer``: a KV request is refused, nothing else happens."""

    def problems(self, request: EngineRequest) -> list[str]:
        if request.kv.any:
            return ["kv_transfer_params ask for a KV hand-off, but this engine runs without --kv-transfer"]
        return []

    def on_add(self, req: ScheduledRequest, intent: KVIntent) -> bool:
        return False

    def pending(self) -> bool:
        return False

    def poll(self) -> None:
        pass

    def before_step(self) -> None:
        pass

    def pulled(self, req: ScheduledRequest) -> bool:
        return False

    def load_prompt(self, req: ScheduledRequest, live: list[ScheduledSequence]) -> bool:
        return False

    def after_decode(self, running: Sequence[ScheduledSequence]) -> None:
        pass

    def on_finish(self, seq: ScheduledSequence, finish: str) -> dict[str, Any] | None:
        return None

    def forget(self, req: ScheduledRequest) -> None:
        pass

    def stats(self) -> KVStats | None:
        return None


class KVHandoffHooks:
    """The hand-off's bookkeeping for the step loop (see the module docstring)."""

    def __init__(
        self,
        handoff: KVHandoff,
        scheduler: Scheduler[ScheduledRequest, ScheduledSequence],
        cache: KVCache,
        fail: FailRequest,
    ) -> None:
        self.handoff = handoff
        self._scheduler = scheduler
        self._cache = cache
        self._fail = fail
        self._exports: set[ScheduledRequest] = set()  # prefill legs: export the prompt's KV when they finish
        self._pulling: dict[str, ScheduledRequest] = {}  # decode legs whose KV is being pulled
        # The prefill's KV of the last prompt position, until the first decode step has run it.
        self._tails: dict[ScheduledRequest, torch.Tensor] = {}

    # -- admission -------------------------------------------------------------------------

    def problems(self, request: EngineRequest) -> list[str]:
        kv = request.kv
        if not kv.any:
            return []
        problems = []
        if kv.export and request.sampling.n != 1:
            problems.append("a prefill leg (do_remote_decode) must have n=1")
        if kv.pull is not None and request.sampling.prompt_logprobs is not None:
            problems.append("prompt_logprobs need the prompt computed here; a decode leg (do_remote_prefill) pulls it")
        return problems

    def on_add(self, req: ScheduledRequest, intent: KVIntent) -> bool:
        if intent.pull is not None:
            keys = req.prefix_keys if req.reads_prefix_cache else []
            problem = self.handoff.begin_pull(req.request_id, intent.pull, req.prompt_len, keys)
            if problem is not None:
                self._pull_failed(req, problem)
            else:
                self._pulling[req.request_id] = req
            return True
        if intent.export:
            self._exports.add(req)
        return False

    def pending(self) -> bool:
        """Pulls in flight: the step loop keeps turning to watch them."""
        return self.handoff.pending()

    def poll(self) -> None:
        """Free the slots of pulled and expired leases."""
        self.handoff.poll()

    def before_step(self) -> None:
        """Move the pulls on: a pulled request enters the scheduler, a failed one meets the policy."""
        progress = self.handoff.advance()
        for rid in progress.ready:
            req = self._pulling.pop(rid, None)
            if req is not None:
                req.held_slot = self.handoff.landed_slot(rid)  # its KV waits there: it computes no prompt token
                self._scheduler.add(req)
        for rid, reason in progress.failed:
            req = self._pulling.pop(rid, None)
            if req is not None:
                self._pull_failed(req, reason)

    # -- the step --------------------------------------------------------------------------

    def pulled(self, req: ScheduledRequest) -> bool:
        """Its prompt's KV waits in its held slot: admitting it computes no prompt token."""
        return req.held_slot is not None

    def load_prompt(self, req: ScheduledRequest, live: list[ScheduledSequence]) -> bool:
        """A pulled decode leg's "prefill": its first live sequence was placed in the slot the KV landed in
        (nothing to copy); its siblings get copies. The last prompt position still runs through the model (in
        the next decode step) for the first token's logits; the KV that step writes for it is then replaced by
        the prefill's, so the cache holds exactly what a coupled server's prefill would have written."""
        if req.held_slot is None:
            return False
        n, cache = req.prompt_len, self._cache
        assert live[0].slot == req.held_slot
        req.held_slot = None
        loaded = self.handoff.load(req.request_id)
        req.cached_tokens, req.kv_pull = loaded.reused_tokens, (loaded.seconds, loaded.bytes)
        for seq in live[1:]:
            cache.copy_slot(live[0].slot, seq.slot, n)
        self._tails[req] = cache.data[:, :, live[0].slot, :, n - 1].clone()
        for seq in live:
            seq.num_cached = n - 1
        return True

    def after_decode(self, running: Sequence[ScheduledSequence]) -> None:
        """After a pulled leg's first decode step: put the prefill's KV of the last prompt position back."""
        if not self._tails:
            return
        done = []
        for seq in running:
            req = seq.request
            tail = self._tails.get(req)
            if tail is None:
                continue
            self._cache.data[:, :, seq.slot, :, req.prompt_len - 1] = tail
            done.append(req)
        for req in done:
            if all(s.num_cached >= req.prompt_len for s in req.sequences if s.live):
                self._tails.pop(req, None)

    def on_finish(self, seq: ScheduledSequence, finish: str) -> dict[str, Any] | None:
        """A prefill leg that ends by length or stop exports its prompt's KV: the params say where. Its slot then
        stays held (the step loop's ``_retire``) until the lease ends."""
        req = seq.request
        if finish not in ("length", "stop") or req not in self._exports:
            return None
        return self.handoff.export(req.request_id, seq.slot, req.prompt_len)

    def forget(self, req: ScheduledRequest) -> None:
        self.handoff.drop(req.request_id)
        self._exports.discard(req)
        self._pulling.pop(req.request_id, None)
        req.held_slot = None
        self._tails.pop(req, None)

    def stats(self) -> KVStats | None:
        return self.handoff.stats()

    # -- internals -------------------------------------------------------------------------

    def _pull_failed(self, req: ScheduledRequest, reason: str) -> None:
        """Apply --kv-load-failure-policy: end the request with the cause, or prefill it here."""
        if self.handoff.spec.failure_policy == "recompute":
            log.warning("KV pull for %s failed (%s): recomputing the prompt here", req.request_id, reason)
            self.handoff.count_recompute()
            self._scheduler.add(req)
            return
        log.warning("KV pull for %s failed: %s", req.request_id, reason)
        self._fail(req, f"KV load failed: {reason}", KV_LOAD_FAILED)
