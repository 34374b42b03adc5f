"""The HTTP edges every route shares, one job per module:

* :mod:`~pdserve.serve.http.body`: reading and decoding a JSON request body (``parse_body``), its limits;
* :mod:`~pdserve.serve.http.errors`: the wire error body (and an engine failure's status and body);
* :mod:`~pdserve.serve.http.handlers`: the error handlers and the one place server errors are counted;
* :mod:`~pdserve.serve.http.gate`: what is refused before any route runs (draining, the API key);
* :mod:`~pdserve.serve.http.protocol`: uvicorn's httptools protocol with a bounded request head and the
  direct body writer of streams;
* :mod:`~pdserve.serve.http.openapi`: the request bodies declared in ``/openapi.json``.

Every error leaves as :class:`~pdserve.protocol.errors.ErrorResponse`: a client's mistake is its
own status (400 unless the error says otherwise); anything unexpected is a 500 with a log line,
so a server bug is never reported as the client's fault.
"""
