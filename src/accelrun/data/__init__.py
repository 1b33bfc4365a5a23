"""Data generated on the spot in real on-disk formats, for machines that cannot download the real data sets
(synthetic_mnist.py: MNIST's idx files, read by torchvision's own loader)."""
