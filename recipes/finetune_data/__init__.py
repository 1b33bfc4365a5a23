"""A language-model fine-tune's data: records on disk or on the hub, read into the examples a causal model
learns from."""
