"""llama.cpp GGUF files: metadata parsing, the embedded tokenizer, and dequantized weights."""
