"""The engine itself, paged vs contiguous at equal KV memory (``study``, ``report``)."""
