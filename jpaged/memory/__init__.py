"""KV memory on the host: the block allocator, block tables, the prefix cache.

numpy only; imports nothing of jpaged's device code.
"""
