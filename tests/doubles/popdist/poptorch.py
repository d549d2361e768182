"""popdist.poptorch double: Options for one poprun instance (its local replicas)."""

from __future__ import annotations

import poptorch

import popdist


def Options(ipus_per_replica: int = 1):
    """popdist.poptorch.Options: a poptorch.Options whose replication factor is this
    instance's local replicas (the real one also wires the instance into the
    distributed run)."""
    opts = poptorch.Options()
    opts.replicationFactor(popdist.getNumLocalReplicas())
    opts.ipus_per_replica = ipus_per_replica
    opts.distributed = popdist.getNumInstances() > 1  # gradients reduce over every instance (R15)
    return opts
