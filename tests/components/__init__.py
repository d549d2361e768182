"""Tests of packed_transformers/components/: the parts every run is built from (run state, the
evaluation schedule, stop codes, agreed time limits, MLPerf logging)."""
