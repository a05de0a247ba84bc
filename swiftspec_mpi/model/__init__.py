"""The models: transformer, model config, tokenizer, checkpoint loaders, CPU linear layers."""
