"""Several processes, one job: what keeps their copies of the engine in lockstep.

In JAX's multi-controller model every process runs the same program. An engine
whose mesh spans processes runs one scheduler per process, each fed the same
requests in the same order; as the scheduler is deterministic, every process
plans the same step and calls the same compiled step with the same shapes, so
their collectives meet. Nothing but the requests may differ between them: the
pool is sized once for all (`smallest_over_processes`), and before each step
the processes compare a digest of their plans (`Lockstep`), failing loudly
instead of waiting forever in a collective the others never reach.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jpaged.core.scheduler_output import SchedulerOutput

PROCESS_AXIS = "processes"
DIGEST_BYTES = 16
# Byte payloads are padded to a power of two at least this long: few shapes to compile.
MIN_PAYLOAD_BYTES = 1024


class LockstepError(RuntimeError):
    """The processes of a job diverged: they planned different steps, or routed different
    requests to their data-parallel replicas."""


def mesh_processes(mesh: Mesh) -> list[int]:
    """The processes holding the mesh's devices, in order."""
    return sorted({device.process_index for device in mesh.devices.flat})


def spans_processes(mesh: Mesh | None) -> bool:
    return mesh is not None and len(mesh_processes(mesh)) > 1


def local_devices(mesh: Mesh) -> list[jax.Device]:
    """The mesh's devices this process drives."""
    return [d for d in mesh.devices.flat if d.process_index == jax.process_index()]


def smallest_over_processes(value: int) -> int:
    """The smallest of every process's `value` (each process must call this in turn):
    what the memory each process measured allows all of them."""
    if jax.process_count() == 1:
        return value
    return int(np.min(multihost_utils.process_allgather(np.int64(value))))


def check_process_layout(meshes: Sequence[Mesh | None]) -> None:
    """ValueError unless the data-parallel replicas on these meshes can run as one job of
    this job's processes (`check_replica_processes`)."""
    if jax.process_count() == 1:
        return
    if any(mesh is None for mesh in meshes):
        raise ValueError(f"a job of {jax.process_count()} processes needs a mesh over "
                         "several devices: give tensor_parallel_size or data_parallel_size")
    check_replica_processes([set(mesh_processes(mesh)) for mesh in meshes],
                            jax.process_count())


def check_replica_processes(holders: Sequence[set[int]], num_processes: int) -> None:
    """ValueError unless replicas held by these processes (holders[i]: replica i's) can run
    as one job: each process drives at least one replica, all the same number (each
    builds and steps its own in turn, and their collectives must meet), and a replica
    that spans processes shares them with no other."""
    for index, processes in enumerate(holders):
        shared = [other for other, held in enumerate(holders)
                  if other != index and held & processes]
        if len(processes) > 1 and shared:
            raise ValueError(f"replica {index} spans processes {sorted(processes)} and shares "
                             f"them with replicas {shared}")
    counts = {process: sum(process in held for held in holders)
              for process in range(num_processes)}
    if min(counts.values()) == 0 or len(set(counts.values())) > 1:
        raise ValueError(f"every process must drive as many replicas as the others, at "
                         f"least one; replicas per process: {counts}")


class ProcessGroup:
    """One device of each of some processes: all-gathers small byte arrays between them
    (over the devices' collectives: gloo on CPUs, the interconnect elsewhere)."""

    def __init__(self, devices: Sequence[jax.Device]):
        first = {}
        for device in devices:
            first.setdefault(device.process_index, device)
        self.processes = sorted(first)
        mesh = Mesh(np.asarray([first[p] for p in self.processes]), (PROCESS_AXIS,))
        self._rows = NamedSharding(mesh, P(PROCESS_AXIS))
        self._gather = jax.jit(lambda rows: rows, out_shardings=NamedSharding(mesh, P()))

    def allgather(self, row: np.ndarray) -> np.ndarray:
        """This process's row [n] -> every process's rows [num_processes, n]; every
        process of the group must call it with the same n."""
        rows = jax.make_array_from_process_local_data(self._rows, row[None])
        return np.asarray(self._gather(rows))

    def allgather_bytes(self, payload: bytes) -> list[bytes]:
        """Every process's payload, in process order (lengths may differ)."""
        lengths = self.allgather(np.asarray([len(payload)], np.int64))[:, 0]
        width = padded_bytes(int(lengths.max()))
        row = np.zeros(width, np.uint8)
        row[: len(payload)] = np.frombuffer(payload, np.uint8)
        rows = self.allgather(row)
        return [rows[i, :n].tobytes() for i, n in enumerate(lengths.tolist())]


def padded_bytes(length: int) -> int:
    """The buffer a payload of `length` bytes travels in: the next power of two, at least
    MIN_PAYLOAD_BYTES."""
    return max(MIN_PAYLOAD_BYTES, 1 << max(length - 1, 0).bit_length())


def schedule_digest(plan: SchedulerOutput, block_tables: Callable) -> bytes:
    """16 bytes that differ, but for a hash collision, whenever two plans differ in the
    sequences they schedule, the tokens fed, the block tables or the block operations."""
    digest = hashlib.blake2b(digest_size=DIGEST_BYTES)
    for seq, num_new in plan.scheduled:
        start = seq.num_computed_tokens
        digest.update(np.asarray([seq.seq_id, start, num_new], np.int64).tobytes())
        digest.update(np.asarray(seq.token_slice(start, start + num_new), np.int64).tobytes())
        for table in block_tables(seq):
            digest.update(b"|" + table.array.tobytes())
    for phase in dataclasses.fields(plan.block_ops):  # every phase of the block operations
        ops = getattr(plan.block_ops, phase.name)
        digest.update(b"/" + np.ascontiguousarray(ops, np.int32).tobytes())
    return digest.digest()


class Lockstep:
    """The check that the processes driving a mesh planned the same step."""

    def __init__(self, mesh: Mesh):
        self.group = ProcessGroup(list(mesh.devices.flat))
        self.num_checks = 0

    def check(self, plan: SchedulerOutput, block_tables: Callable) -> None:
        """LockstepError, on every process, unless every process's plan has this digest."""
        digest = np.frombuffer(schedule_digest(plan, block_tables), np.uint8)
        rows = self.group.allgather(digest)
        self.num_checks += 1
        if (rows != rows[0]).any():
            differing = [p for p, row in zip(self.group.processes, rows, strict=True)
                         if (row != rows[0]).any()]
            raise LockstepError(
                f"step {self.num_checks}: processes {differing} planned another step than "
                f"process {self.group.processes[0]}: their requests, or the order they "
                "came in, differ")
