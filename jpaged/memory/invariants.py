"""The block invariant both block managers check: reference counts equal a recount."""

from __future__ import annotations

import numpy as np

from jpaged.memory.allocator import BlockPool


def holder_problems(name: str, pool: BlockPool, tables: list[np.ndarray],
                     first: int) -> list[str]:
    """Where the pool's refcounts (from block `first` on) differ from a recount of the
    tables, and whether its free count (deferred blocks included) matches the blocks
    nobody holds."""
    refcounts = pool.refcounts[first:]
    held = np.zeros(pool.num_blocks, np.int64)
    for table in tables:
        np.add.at(held, table, 1)
    held = held[first:]
    problems = [f"{name} block {first + b}: refcount {refcounts[b]}, held by {held[b]} tables"
                for b in np.flatnonzero(refcounts != held)]
    unheld = np.count_nonzero(refcounts == 0)
    # Free blocks the open step's ops still touch wait in the deferred list.
    num_free = int(pool.num_free) + int(pool.num_deferred)
    if num_free != unheld:
        problems.append(f"{num_free} free {name} blocks, {unheld} unreferenced")
    return problems
