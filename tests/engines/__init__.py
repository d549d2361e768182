"""Tests of packed_transformers/engines/: the one torch step and the IPU plan held to it (the
step proof: thirteen jobs through every engine they run on)."""
