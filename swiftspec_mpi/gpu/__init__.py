"""The GPU path: kernel launch layer and wrappers, fused ops, CUDA graphs, NCCL."""
