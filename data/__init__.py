"""Raw text -> unpacked pretraining shards (ARCHITECTURE.md section 2). Knows nothing of packs."""
