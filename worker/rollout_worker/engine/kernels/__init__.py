"""The fixed-order and packed kernels the decoder is built from, chosen once from the engine settings."""
