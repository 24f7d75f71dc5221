"""The OpenAI-compatible server over the online engine (``engine/async_llm.py``): ``app`` (routes),
``protocol`` (request bodies), ``responses`` (response objects and SSE chunks), ``metrics``
(Prometheus), ``launch`` (foreground or on a thread). Needs the ``serve`` extra (FastAPI, uvicorn)."""
