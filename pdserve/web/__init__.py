"""Small pieces of HTTP handling that the server (``serve/``) and the proxy (``proxy/``) share."""
