"""``pdserve top``: a live terminal view of a proxy's fleet, built from the proxy's and its members'
``/metrics`` alone, so it works against any running fleet without new endpoints or an agent on the hosts.

quantile.py: histogram arithmetic (pure); scrape.py: fetch and parse; view.py: rows and rendering;
cli.py: flags and the refresh loop.
"""
