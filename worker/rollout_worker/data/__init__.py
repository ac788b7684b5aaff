"""A job's data on disk, torch-free: prompts (JSONL or Parquet), bounded reads and safe writes, JSON Lines,
the math reward."""
