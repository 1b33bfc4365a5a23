"""Data generated on the spot in real on-disk formats, for machines that cannot download the real data sets."""
