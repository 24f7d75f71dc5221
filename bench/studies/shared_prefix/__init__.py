"""The vLLM paper's Fig. 16: serving behind a shared few-shot prefix, prefix caching on and off, against
Orca (``study``, with ``report``)."""
