"""Real image files for recipes/resnet.py: class folders of PNG and JPEG files that ImageFolder reads.

Two classes a ResNet can learn in a few steps: horizontal and vertical stripes, with a random
colour, stripe width and phase per image.
"""

import numpy as np
from PIL import Image

CLASSES = ("horizontal", "vertical")


def striped_image(rng, size, vertical):
    width = rng.integers(2, 5)
    phase = rng.integers(0, width * 2)
    lines = ((np.arange(size) + phase) // width) % 2
    mask = np.tile(lines, (size, 1)) if vertical else np.tile(lines[:, None], (1, size))
    colour = rng.integers(60, 256, size=3)
    pixels = mask[..., None] * colour + rng.normal(0, 12, size=(size, size, 3))
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def write_image_folder(root, train_per_class, val_per_class, size=20, seed=0):
    """root/train/<class>/*.png|jpg and root/val/<class>/...; every other file is a JPEG."""
    rng = np.random.default_rng(seed)
    for split, count in (("train", train_per_class), ("val", val_per_class)):
        for label, name in enumerate(CLASSES):
            folder = root / split / name
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                image = striped_image(rng, size, vertical=label == 1)
                image.save(folder / (f"{i:04d}.jpg" if i % 2 else f"{i:04d}.png"), quality=90)
    return root
