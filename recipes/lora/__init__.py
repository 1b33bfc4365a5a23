"""Low-rank adapters (LoRA) through PEFT, for a fine-tune that trains adapters on a frozen model."""
