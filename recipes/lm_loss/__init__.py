"""The next-token loss of a Hugging Face causal LM, computed through its output layer in chunks (chunked.py; its
flag in flags.py, which imports no torch)."""
