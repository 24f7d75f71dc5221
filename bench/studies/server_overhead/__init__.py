"""What the HTTP server adds per streamed token and to TTFT at low load (``study``)."""
