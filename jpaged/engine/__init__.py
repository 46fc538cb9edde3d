"""The engine: `LLMEngine` over its input processor, engine core and output processor;
the jit-compiled runner; start-up (machine defaults, KV pool sizing, compilation);
the async and data-parallel wrappers."""
