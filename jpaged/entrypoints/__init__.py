"""What users call: the offline `LLM` and the OpenAI-compatible HTTP server."""
