"""Drafting tokens for speculative decoding without a draft model (torch-free)."""
