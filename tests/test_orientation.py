"""The one EXIF orientation table: PIL's reading of the tag, and the box mapping with it."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image, ImageOps

from gpucache.transforms._orientation import ORIENT, coded_box, orient, steps, steps_of


def test_orient_shows_the_image_as_pil_does_for_every_value():
    stored = np.random.default_rng(0).integers(0, 256, (5, 7, 3), dtype=np.uint8)
    for o in range(1, 9):
        im = Image.fromarray(stored)
        exif = im.getexif()
        exif[0x0112] = o
        im.info["exif"] = exif.tobytes()
        want = np.asarray(ImageOps.exif_transpose(im))
        got = orient(torch.from_numpy(stored).permute(2, 0, 1), o).permute(1, 2, 0).numpy()
        assert np.array_equal(got, want), o


def test_a_box_mapped_to_the_stored_image_holds_the_same_pixels():
    stored = torch.arange(3 * 6 * 9).reshape(3, 6, 9)
    for o in range(1, 9):
        shown = orient(stored, o)
        h, w = shown.shape[1:]
        ct, cl, ch, cw = coded_box(1, 2, 3, 4, o, h, w)
        assert torch.equal(orient(stored[:, ct : ct + ch, cl : cl + cw], o), shown[:, 1:4, 2:6])


def test_values_outside_the_tag_mean_none_and_the_vector_form_agrees():
    assert steps(0) == steps(9) == steps(-3) == ORIENT[1]
    o = np.array([0, 1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert [tuple(r) for r in steps_of(o).tolist()] == [steps(int(v)) for v in o]
