"""Step 3, merge: stream the planned blocks through a method into safetensors shards.

merge.py is the loop; prefetch.py reads ahead, hashing.py checks and hashes, cuts.py
looks up rank cuts, layout.py names the output files."""
