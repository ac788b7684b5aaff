"""The kernels the decoder is built from, chosen once from the engine settings (:mod:`.choice`): packed
products (:mod:`.packed_linear`), the deterministic kernels (:mod:`.row_rules`, :mod:`.row_chunks`,
:mod:`.row_parallel`, :mod:`.tree_sums`, :mod:`.deterministic_attention`), torch's attention
(:mod:`.torch_attention`) and the fixed-order C++ kernel for CPUs (:mod:`.fixed_order`)."""
