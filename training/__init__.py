"""Training: config schema, data loading, the step, evaluation, checkpoints, logging, backends."""
