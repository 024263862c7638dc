"""Small shared helpers with no knowledge of models: progress lines, allocator tuning,
files (fs.py: atomic writes, canonical JSON, file hashes)."""
