"""Multi-turn sessions on a device-only prefix cache: hit rate and TTFT per round, at a KV budget that holds
every session's history and at one that cannot (``study``, with ``report``)."""
