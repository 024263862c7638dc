"""Small shared helpers with no knowledge of models: progress lines, allocator tuning, files."""
