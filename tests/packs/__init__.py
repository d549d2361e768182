"""Tests of packed_transformers/packs/: the packing algorithms, the LP packer's determinism, and
the decoder rows' format."""
