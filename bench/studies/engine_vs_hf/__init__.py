"""The engine against Hugging Face ``generate`` on the same model (``study``, ``report``)."""
