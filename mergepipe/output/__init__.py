"""Step 4, the output: the manifest and its checks, and atomic publication of a merged folder."""
