"""boxnp's harness for the kvgroups conformance kit: make a BoxArray, read one back."""

import numpy as np

from kvgroups_conformance import Harness
from kvgroups_conformance.caches import copy_keeping_strides

from . import BoxArray


class BoxHarness(Harness):
    def __init__(self) -> None:
        super().__init__("boxnp", "boxnp", keeps_padding=True)

    def from_numpy(self, a: np.ndarray) -> BoxArray:
        return BoxArray(copy_keeping_strides(a))  # padded blocks stay padded

    def to_numpy(self, x: BoxArray, like: np.ndarray) -> np.ndarray:
        return copy_keeping_strides(x.data).view(like.dtype)
