"""The Qwen3.5 / Qwen3-Next family: gated DeltaNet and gated attention layers, and the MTP head."""
