"""Raw text -> unpacked pretraining shards (DESIGN.md section 2). Knows nothing of packs."""
