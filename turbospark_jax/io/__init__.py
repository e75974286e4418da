"""Reading and writing model folders, tokenizers and images."""
