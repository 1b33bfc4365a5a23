"""Data generated on the spot in real on-disk formats, for machines that cannot download the real data sets; each
runs alone as `python -m accelrun.data.NAME DIR` (--help says what it writes):
synthetic_mnist.py (MNIST's idx files, read by torchvision's own loader), image_folder.py (class folders of striped
PNG and JPEG images for recipes/resnet.py), tiny_hf.py (a tiny Llama, its tokenizer and chat data for
recipes/finetune_lm.py)."""
