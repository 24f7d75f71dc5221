"""The vLLM paper's Fig. 17: a chatbot whose prompts carry the conversation's last 1024 tokens, paged
against Orca (``study``, with ``report``)."""
