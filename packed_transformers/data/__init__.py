"""Raw text -> tokens and unpacked pretraining shards (ARCHITECTURE.md section 2), the text
rule every reader applies, SQuAD and classification data. Uses packing/'s unpacked HDF5
layout; never knows about packs, never imports torch, model/, training/ or the rooms above.
"""
