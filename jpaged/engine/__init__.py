"""The engine: `LLMEngine` over its input processor, engine core and output processor;
start-up (machine defaults, the attention backend, KV pool sizing, the compilation
cache); the async and data-parallel wrappers. What runs a step on the device is the
worker's (jpaged.worker)."""
