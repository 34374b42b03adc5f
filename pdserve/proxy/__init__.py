"""``pdserve proxy``: the OpenAI front of a P/D topology (render once, prefill leg, decode leg).

Modules, one job each: :mod:`~pdserve.proxy.legs` (what each leg's generate body carries),
:mod:`~pdserve.proxy.pool` (members, least-busy of two random picks, health), :mod:`~pdserve.proxy.upstream` (HTTP to a
pool member, errors mapped to client statuses), :mod:`~pdserve.proxy.relay` (a decode leg's
generate and derender output on the server's own response surfaces, :mod:`pdserve.output.surfaces`), :mod:`~pdserve.proxy.flow` (the two modes end to end),
:mod:`~pdserve.proxy.modes` (``--mode``), :mod:`~pdserve.proxy.preflight` (which output modes a decode
member serves), :mod:`~pdserve.proxy.record` (one request's legs: ``Server-Timing``, per-request metrics),
:mod:`~pdserve.proxy.metrics`, :mod:`~pdserve.proxy.app`
(routes), :mod:`~pdserve.proxy.cli` (flags) and :mod:`~pdserve.proxy.server` (banner, uvicorn).
It imports only the layers below ``serve``: it talks to servers over HTTP, never in-process.
"""
