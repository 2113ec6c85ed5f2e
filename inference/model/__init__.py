"""The Kimi K3 model: configuration, layers, checkpoint, tokenizer."""
