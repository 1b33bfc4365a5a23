"""A pretrained Hugging Face model, loaded for a fine-tune under every engine (loading.py), its weight files checked
and fingerprinted without loading them (weights.py)."""
