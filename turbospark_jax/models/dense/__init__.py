"""The dense decoder family (Llama, Qwen2, Qwen3, Mistral and their kin)."""
