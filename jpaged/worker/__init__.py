"""The worker: what runs a scheduled step on the device. The model runner (compiled
steps, the KV cache, block operations), the decode loop, the sampling rows of a plan,
and the step runners that turn a plan into sampled tokens (one step, or a decode loop)
behind one interface."""
