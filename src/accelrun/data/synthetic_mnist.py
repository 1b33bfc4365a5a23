"""A learnable stand-in for MNIST, written in MNIST's own idx format.

Compute nodes and CI machines often cannot download MNIST. Rather than swap in
random tensors (which would skip the real loading code and teach nothing), this
module draws digits 0-9 as pen strokes, jitters them (shift, rotation, scale,
slant, stroke width, noise) and writes the four idx files that
`torchvision.datasets.MNIST` reads. The recipe then loads them through
torchvision exactly as it would load the real thing.

It is a data generator, not a recipe: it makes no distributed calls. Run alone, it writes the digits for the
quickstart (recipes/quickstart/) on a machine that cannot download MNIST:

    python -m accelrun.data.synthetic_mnist data/synthetic   # then --data-dir data/synthetic
"""

import argparse
import json
import os
import struct

import numpy as np
import torch


# Each digit is a list of strokes; each stroke is a list of (x, y) points in a
# unit box, y pointing down. Arcs are sampled from ellipses below.
def _arc(cx, cy, rx, ry, start_deg, end_deg, n=14):
    t = np.radians(np.linspace(start_deg, end_deg, n))
    return list(zip(cx + rx * np.cos(t), cy + ry * np.sin(t)))


GLYPHS = {
    0: [_arc(0.5, 0.5, 0.28, 0.4, 0, 360, 24)],
    1: [[(0.35, 0.25), (0.55, 0.1), (0.55, 0.9)], [(0.35, 0.9), (0.75, 0.9)]],
    2: [_arc(0.5, 0.32, 0.26, 0.22, 190, 380) + [(0.25, 0.9), (0.78, 0.9)]],
    3: [_arc(0.5, 0.3, 0.24, 0.2, 200, 450), _arc(0.5, 0.7, 0.27, 0.2, 270, 520)],
    4: [[(0.65, 0.9), (0.65, 0.1), (0.2, 0.65), (0.82, 0.65)]],
    5: [[(0.75, 0.1), (0.3, 0.1), (0.27, 0.45)] + _arc(0.5, 0.65, 0.27, 0.25, 235, 500)],
    6: [_arc(0.5, 0.68, 0.25, 0.22, 0, 360, 20), [(0.27, 0.65), (0.4, 0.3), (0.65, 0.1)]],
    7: [[(0.22, 0.1), (0.78, 0.1), (0.42, 0.9)], [(0.38, 0.5), (0.68, 0.5)]],
    8: [_arc(0.5, 0.29, 0.22, 0.19, 0, 360, 20), _arc(0.5, 0.7, 0.27, 0.21, 0, 360, 20)],
    9: [_arc(0.5, 0.32, 0.25, 0.22, 0, 360, 20), [(0.74, 0.35), (0.6, 0.7), (0.35, 0.9)]],
}


def _dense_points(strokes, step=0.04):
    """Resample every stroke so that consecutive points are at most `step` apart."""
    points = []
    for stroke in strokes:
        stroke = np.asarray(stroke, dtype=np.float64)
        for a, b in zip(stroke[:-1], stroke[1:]):
            n = max(2, int(np.ceil(np.linalg.norm(b - a) / step)) + 1)
            points.append(a + np.linspace(0, 1, n)[:, None] * (b - a))
    return np.concatenate(points)


_DIGIT_POINTS = {d: _dense_points(s) for d, s in GLYPHS.items()}
_GRID = np.meshgrid(np.arange(28) + 0.5, np.arange(28) + 0.5, indexing="xy")
_PIXELS = torch.from_numpy(np.stack(_GRID, -1).reshape(1, -1, 2).astype(np.float32))


def render_digits(labels, rng, chunk=256):
    """Draw one 28x28 uint8 image per label with random pen, pose and noise."""
    labels = np.asarray(labels)
    images = np.empty((len(labels), 28 * 28), dtype=np.float32)
    n = len(labels)
    angle = np.radians(rng.uniform(-15, 15, n))
    scale = rng.uniform(15.0, 20.0, n)
    slant = rng.uniform(-0.25, 0.25, n)
    shift = rng.uniform(-2.5, 2.5, (n, 2))
    width = rng.uniform(0.8, 1.8, n)
    # Rotation times shear, one 2x2 matrix per image, scaled to pixels.
    cos, sin = np.cos(angle), np.sin(angle)
    pose = np.stack([np.stack([cos, cos * slant - sin], -1), np.stack([sin, sin * slant + cos], -1)], -2)
    pose *= scale[:, None, None]
    for digit, points in _DIGIT_POINTS.items():
        index = np.flatnonzero(labels == digit)
        for start in range(0, len(index), chunk):
            idx = index[start:start + chunk]
            pts = np.einsum("pj,nij->npi", points - 0.5, pose[idx]) + 14.0 + shift[idx, None, :]
            # Distance from every pixel centre to the nearest point on the pen's path.
            pts = torch.from_numpy(pts.astype(np.float32))
            dist = torch.cdist(_PIXELS.expand(len(idx), -1, -1), pts).amin(-1).numpy()
            images[idx] = np.clip(1.0 - (dist - width[idx, None]), 0.0, 1.0)
    images = images * rng.uniform(0.7, 1.0, (n, 1)) + rng.normal(0.0, 0.08, images.shape)
    return np.clip(images * 255.0, 0, 255).astype(np.uint8).reshape(-1, 28, 28)


def _write_idx(path, array):
    """MNIST's idx format: big-endian magic (0x08 = uint8, then ndim), dims, raw bytes."""
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack(">HBB", 0, 0x08, array.ndim))
        f.write(struct.pack(">" + "I" * array.ndim, *array.shape))
        f.write(np.ascontiguousarray(array, dtype=np.uint8).tobytes())
    os.replace(tmp, path)  # never leave a half-written file under the real name


def write_synthetic_mnist(root, train_size, test_size, seed=0):
    """Write train/test idx files under `root/MNIST/raw`, unless identical ones exist.

    Returns `root`, ready to pass to `torchvision.datasets.MNIST(root=...)`.
    """
    raw = os.path.join(root, "MNIST", "raw")
    stamp = os.path.join(raw, "synthetic.json")
    params = {"train_size": train_size, "test_size": test_size, "seed": seed, "version": 1}
    if os.path.exists(stamp):
        with open(stamp) as f:
            if json.load(f) == params:
                return root
    os.makedirs(raw, exist_ok=True)
    rng = np.random.default_rng(seed)
    for prefix, size in (("train", train_size), ("t10k", test_size)):
        labels = rng.integers(0, 10, size=size).astype(np.uint8)
        _write_idx(os.path.join(raw, f"{prefix}-images-idx3-ubyte"), render_digits(labels, rng))
        _write_idx(os.path.join(raw, f"{prefix}-labels-idx1-ubyte"), labels)
    with open(stamp, "w") as f:
        json.dump(params, f)
    return root


if __name__ == "__main__":
    p = argparse.ArgumentParser(description="Write synthetic digits in MNIST's idx format into DIR/MNIST/raw, where "
                                "torchvision.datasets.MNIST(DIR) reads them.", allow_abbrev=False,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("dir", metavar="DIR", help="the MNIST root to write (then --data-dir DIR)")
    p.add_argument("--train-size", type=int, default=20000, help="training images")
    p.add_argument("--test-size", type=int, default=5000, help="test images")
    args = p.parse_args()
    print(f"synthetic digits in MNIST's format: {write_synthetic_mnist(args.dir, args.train_size, args.test_size)}")
