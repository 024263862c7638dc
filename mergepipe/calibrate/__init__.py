"""Calibration: importance of the base model's weights from text the user supplies,
for the `calibrated` plan strategy. fisher.py runs the base (transformers, torch) and
factors a diagonal Fisher per tensor; artifact.py stores it content-addressed and reads
it back as untrusted input. Only plans that ask for `strategy: calibrated` import this."""
