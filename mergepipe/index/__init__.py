"""Step 1, index: per-block hashes, delta statistics and exact rank cuts, cached by content.

Torch-free: importing the index (or a cached `mergepipe index`) must not pay for torch."""
