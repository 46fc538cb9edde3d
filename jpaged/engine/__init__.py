"""The engine: the jit-compiled runner, `LLMEngine`, its async wrapper, and the
host-side bookkeeping of a request's outputs (detokenizer, beams, stats)."""
