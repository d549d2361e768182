"""A test double of the `popart` Python module (Poplar SDK 3.4): tests only.

Only the enums the IPU engine reads for its PopART session options, with PopART's values
(popart/sessionoptions.hpp: AccumulateOuterFragmentSchedule, SubgraphCopyingStrategy;
popart/dataflow.hpp: SyntheticDataMode)."""

from __future__ import annotations

import enum


class AccumulateOuterFragmentSchedule(enum.IntEnum):
    Scheduler = 0
    Serial = 1
    OverlapCycleOptimized = 2
    OverlapMemoryOptimized = 3


class SubgraphCopyingStrategy(enum.IntEnum):
    OnEnterAndExit = 0
    JustInTime = 1


class SyntheticDataMode(enum.IntEnum):
    Off = 0
    Zeros = 1
    RandomNormal = 2
