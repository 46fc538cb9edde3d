"""The device side of a step: the Llama-family model, its loaders, the sampler."""
