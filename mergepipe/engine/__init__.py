"""Step 3, merge: stream the planned blocks through a method into safetensors shards."""
