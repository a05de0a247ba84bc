"""The decoder itself: model config, tensor-parallel shard, RoPE, the fused per-layer weights, the
Transformer forward (prefill, chain and tree steps) and the fill of its weights from a TensorSource."""
