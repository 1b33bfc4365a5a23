"""Real image files for recipes/resnet.py: class folders of PNG and JPEG files that ImageFolder reads.

Two classes a ResNet can learn in a few steps: horizontal and vertical stripes, with a random
colour, stripe width and phase per image. It is a data generator, not a recipe: it makes no distributed calls.
Run alone, it writes them for a machine that cannot download an image data set:

    python -m accelrun.data.image_folder data/stripes
    python recipes/resnet.py --data-dir data/stripes --image-size 32 ...

numpy and Pillow (torchvision's) are imported only when images are written: --help needs neither.
"""

import argparse
from pathlib import Path

from accelrun.flags import whole_number_type

CLASSES = ("horizontal", "vertical")


def striped_image(rng, size, vertical):
    import numpy as np
    from PIL import Image

    width = rng.integers(2, 5)
    phase = rng.integers(0, width * 2)
    lines = ((np.arange(size) + phase) // width) % 2
    mask = np.tile(lines, (size, 1)) if vertical else np.tile(lines[:, None], (1, size))
    colour = rng.integers(60, 256, size=3)
    pixels = mask[..., None] * colour + rng.normal(0, 12, size=(size, size, 3))
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def write_image_folder(root, train_per_class, val_per_class, size=20, seed=0):
    """root/train/<class>/*.png|jpg and root/val/<class>/...; every other file is a JPEG."""
    import numpy as np

    root = Path(root)
    rng = np.random.default_rng(seed)
    for split, count in (("train", train_per_class), ("val", val_per_class)):
        for label, name in enumerate(CLASSES):
            folder = root / split / name
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                image = striped_image(rng, size, vertical=label == 1)
                image.save(folder / (f"{i:04d}.jpg" if i % 2 else f"{i:04d}.png"), quality=90)
    return root


whole_number = whole_number_type(1)  # argparse type: an int of at least 1, else one line naming it


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m accelrun.data.image_folder", allow_abbrev=False,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Write two classes of striped images (horizontal, vertical) as DIR/train/<class>/ and "
        "DIR/val/<class>/ PNG and JPEG files, for recipes/resnet.py on a machine that cannot download a data set.",
        epilog="Then: python recipes/resnet.py --data-dir DIR --image-size SIZE")
    p.add_argument("dir", nargs="?", default="stripes", metavar="DIR", help="the directory to write")
    p.add_argument("--train-per-class", type=whole_number, default=512, help="training images per class")
    p.add_argument("--val-per-class", type=whole_number, default=64, help="validation images per class")
    p.add_argument("--size", type=whole_number, default=32, help="each image's side in pixels")
    p.add_argument("--seed", type=int, default=0, help="the random seed: the same seed writes the same images")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    print(write_image_folder(Path(args.dir), args.train_per_class, args.val_per_class, args.size, args.seed))


if __name__ == "__main__":
    main()
