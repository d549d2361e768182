"""Rows for causal-LM pretraining: documents -> rows of S tokens (layouts: document-masked
packs or the reference's concatenated stream), proven to hold every document token exactly
once, and their folder on disk (store). Pure numpy and h5py, as the rest of packs/: never
imports torch, model/ or any room above packs/.
"""
