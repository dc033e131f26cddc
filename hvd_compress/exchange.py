"""How payloads travel between ranks, and the bytes each way costs.

Byte accounting is per worker per step, counting what a worker sends (the
same as it receives for these symmetric collectives), for the algorithms
Horovod's CPU back ends run: ring allreduce, and allgather in which every
worker sends its payload to each of the n - 1 others.
"""


def allreduce_bytes(payload_bytes, size):
    """Ring allreduce: reduce-scatter then allgather, 2 (n-1)/n of the payload each."""
    return 2 * (size - 1) * payload_bytes / size if size > 1 else 0.0


def allgather_bytes(payload_bytes, size):
    """Allgather: each worker's payload reaches the n - 1 others."""
    return (size - 1) * payload_bytes if size > 1 else 0.0
