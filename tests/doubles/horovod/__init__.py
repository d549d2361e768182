"""A test double of Horovod: tests only (see horovod/torch)."""
