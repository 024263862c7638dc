"""What a user runs, composed from the steps: run, split merges, sweeps, explain, gc, the demo."""
