"""Whether a chart that a run or bench/ drew really shows something: a PNG that decodes, of the figure's
size, not blank, with the expected curves' and bars' colours.
"""

import numpy as np
from PIL import Image

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# matplotlib's default cycle (tab:blue, tab:orange, tab:green) and the bench chart's tab:red / tab:purple
TAB_BLUE, TAB_ORANGE, TAB_GREEN = (31, 119, 180), (255, 127, 14), (44, 160, 44)
TAB_RED, TAB_PURPLE = (214, 39, 40), (148, 103, 189)


def assert_drawn_png(path, size, colours):
    """A PNG that decodes, of the figure's size (figsize x dpi 100), not blank, and with at least 50 pixels
    of each of `colours` (within antialiasing distance): the curves and bars were really drawn."""
    assert path.read_bytes().startswith(PNG_MAGIC)
    with Image.open(path) as image:
        image.load()
        assert image.size == size, (path, image.size)
        pixels = np.asarray(image.convert("RGB"), dtype=np.int16).reshape(-1, 3)
    white = (pixels == 255).all(axis=1)
    assert len(np.unique(pixels, axis=0)) > 16 and (~white).mean() > 0.02, f"{path} is (nearly) blank"
    for colour in colours:
        near = (np.abs(pixels - np.array(colour)).max(axis=1) <= 24).sum()
        assert near >= 50, f"{path}: only {near} pixels of colour {colour}"
