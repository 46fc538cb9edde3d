"""KV memory on the host: the block allocator, block tables, the prefix cache, and the
two KV cache managers the scheduler runs on (paged blocks, Orca's reservations).

numpy only; imports nothing of jpaged's device code.
"""
