"""Ops under tensor parallelism: the mesh axis that heads split over, and running an op on
each device's own heads (`per_shard`), which the attention op and KV writes use because
XLA does not partition Pallas kernels or custom calls."""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

# The mesh axis that tensor parallelism splits heads over (see models/sharding.py).
TENSOR_AXIS = "tensor"

HEADS = P(None, TENSOR_AXIS, None)  # q, k, v, attention outputs: [T, heads, D]


def per_shard(fn, mesh, in_specs, out_specs):
    """`fn` on each device's heads under `shard_map` when `mesh` splits them; else `fn`."""
    if mesh is None or mesh.shape.get(TENSOR_AXIS, 1) == 1:
        return fn
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=False)
