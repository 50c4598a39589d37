"""boxnp's harness for the kvgroups conformance kit: make a BoxArray, read one back."""

import numpy as np

from kvgroups_conformance import Harness

from . import BoxArray


class BoxHarness(Harness):
    def __init__(self) -> None:
        super().__init__("boxnp", "boxnp")

    def from_numpy(self, a: np.ndarray) -> BoxArray:
        return BoxArray(a.copy())

    def to_numpy(self, x: BoxArray, like: np.ndarray) -> np.ndarray:
        return x.data.copy().view(like.dtype)
