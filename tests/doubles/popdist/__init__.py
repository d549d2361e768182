"""A test double of PopDist (Poplar SDK 3.4), the instance topology poprun gives each
process: tests only. The real module reads what poprun exported; the double reads
DOUBLE_POPDIST_INSTANCES / _INSTANCE / _REPLICAS (set by tests/training/test_ipu_double.py).

Rules encoded, from Graphcore's own use of the API (graphcore/examples, nlp/bert/pytorch
args.py init_popdist; the PopART BERT's set_popdist_args):
P1 isPopdistEnvSet() is False outside poprun; the getters describe this instance.
P2 total replicas = local replicas x instances (asserted by Graphcore's BERT).
"""

from __future__ import annotations

import os

_initialised = False


def isPopdistEnvSet() -> bool:
    return "DOUBLE_POPDIST_INSTANCES" in os.environ


def init() -> None:
    global _initialised
    _initialised = True


def getNumInstances() -> int:
    return int(os.environ["DOUBLE_POPDIST_INSTANCES"])


def getInstanceIndex() -> int:
    return int(os.environ["DOUBLE_POPDIST_INSTANCE"])


def getNumTotalReplicas() -> int:
    return int(os.environ["DOUBLE_POPDIST_REPLICAS"])


def getNumLocalReplicas() -> int:
    total, instances = getNumTotalReplicas(), getNumInstances()
    assert total % instances == 0, "P2: replicas must split evenly over instances"
    return total // instances
