"""The Fig. 2/13 gap explained: the paged mean batch and token-state share against the vLLM paper's,
decomposed into causes, one simulator knob at a time (:mod:`.study`)."""
