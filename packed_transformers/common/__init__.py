"""The bottom of the house: helpers every room may use (atomic file writes, sha256, the
config-schema machinery, the names options choose from, the commands' one-line errors).
Never imports another project package, torch or numpy.
"""
