"""Checkpoint I/O: the safetensors format read and written by hand, and the block layout of a tensor."""
