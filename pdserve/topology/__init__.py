"""``pdserve up``: a whole P/D topology on loopback (render, prefill and decode pools, the proxy),
planned in :mod:`~pdserve.topology.plan`, run and supervised by :mod:`~pdserve.topology.supervise`."""
