"""``llmgw gateway``: the OpenAI-compatible front door to ready replicas.

Modules: ``router`` (which replica serves a request; pure, no I/O), ``proxy``
(forwarding one request upstream, with its single retry), ``auth`` (hashed API
keys), ``errors`` (OpenAI-shaped error answers), ``metrics``, ``server`` (the
routes), ``httpserver`` (HTTP/1.1 on httptools), ``upstream`` (the keep-alive
client to engines) and ``service`` (the process: NATS watch + HTTP).
"""
