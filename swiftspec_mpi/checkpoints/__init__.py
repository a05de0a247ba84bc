"""Checkpoints: Hugging Face (safetensors, AWQ/GPTQ) and GGUF readers, tokenizers, the model
registry and its downloads, dummy (random) and tiny generated models; `load` builds a Transformer
from any of them."""
