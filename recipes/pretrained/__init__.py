"""A pretrained Hugging Face model, loaded for a fine-tune under every engine (loading.py)."""
