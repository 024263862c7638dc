"""Step 2, plan: which (expert, block) pairs to read under the expert-I/O budget."""
