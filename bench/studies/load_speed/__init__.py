"""Building ``LLM`` on SmolLM2 against reading its weight files (``study``)."""
