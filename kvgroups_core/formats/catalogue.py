"""The catalogue of engine KV formats (docs/FORMATS.md) and the facts each one carries.

A format names the *structure* an engine registers (one tensor, a list of per-layer tensors,
or a K list and a V list) and the axis order inside each tensor. The axis order is kept as
data (``axes``), so geometry is read generically from a tensor's shape and strides
(:mod:`kvgroups_core.formats.layout`) instead of one hand-written accessor per format.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

# Structures an engine registers.
CROSS_LAYER = "cross_layer"  # one tensor holding every layer
LAYER_LIST = "layer_list"  # list[NL] of per-layer tensors
LAYER_PAIR_LIST = "layer_pair_list"  # list[NL] of (K, V) tensor pairs
KV_LIST = "kv_list"  # [K list[NL], V list[NL]]


@dataclass(frozen=True)
class FormatFacts:
    """What a format is.

    ``axes`` is the axis order of each backing tensor, using NB, BS, NH, HS, CS (packed K/V
    row, acting as the head size), NL (layers, cross-layer tensors only), TWO (the K/V
    axis), ONE (an axis of size 1) and BSV_BSS (the blocked-scale indexer row area); the
    recurrent-state formats use CD (conv channels), CW (conv window), SH (state heads) and SS
    (the rest of one head's state, one or more axes). ``producers`` is documentation.
    ``recurrent_state`` marks the state formats (docs/SEMANTICS.md section 9).
    """

    axes: tuple[str, ...]
    structure: str
    producers: str
    groupable: bool = True
    must_have: bool = True
    recurrent_state: bool = False

    @property
    def kv_size(self) -> int:
        """2 for split K/V planes, 1 for MLA-class, CS-packed and indexer formats."""
        if "TWO" in self.axes or self.structure in (KV_LIST, LAYER_PAIR_LIST):
            return 2
        return 1

    @property
    def is_fused_packed(self) -> bool:
        return "CS" in self.axes

    @property
    def is_indexer(self) -> bool:
        return "BSV_BSS" in self.axes

    @property
    def is_mla(self) -> bool:
        """One latent plane per token and no head axis (MLA caches, compressed pools and the
        indexer cache)."""
        return self.kv_size == 1 and "NH" not in self.axes and not self.recurrent_state

    @property
    def is_hnd(self) -> bool:
        """Heads outer to tokens (``[NH, BS, HS]`` inside a block, or heads outermost)."""
        return (
            "NH" in self.axes
            and "BS" in self.axes
            and self.axes.index("NH") < self.axes.index("BS")
        )

    @property
    def is_cross_layer(self) -> bool:
        return self.structure == CROSS_LAYER

    @property
    def is_kv_list(self) -> bool:
        return self.structure == KV_LIST

    @property
    def is_layer_list(self) -> bool:
        return self.structure in (LAYER_LIST, LAYER_PAIR_LIST)

    @property
    def block_axis_first(self) -> bool:
        """Dim 0 of each backing tensor is the block axis (so blocks may be padded)."""
        return bool(self.axes) and self.axes[0] == "NB"


def _f(axes: str, structure: str, producers: str, **kw: bool) -> FormatFacts:
    return FormatFacts(tuple(axes.split()), structure, producers, **kw)


class EngineKVFormat(enum.Enum):
    """Engine KV formats, named as in LMCache's ``EngineKVFormat``.

    Each member carries its :class:`FormatFacts`; the common facts are also attributes of the
    member (``EngineKVFormat.NL_X_NB_BS_HS.is_mla``).
    """

    # --- must have -------------------------------------------------------------------
    NL_X_TWO_NB_BS_NH_HS = _f("TWO NB BS NH HS", LAYER_LIST, "vLLM FlashAttention (NHD)")
    NL_X_TWO_NB_NH_BS_HS = _f("TWO NB NH BS HS", LAYER_LIST, "vLLM FlashAttention (HND)")
    NL_X_NB_TWO_BS_NH_HS = _f("NB TWO BS NH HS", LAYER_LIST, "vLLM FlashInfer (NHD)")
    NL_X_NB_TWO_NH_BS_HS = _f("NB TWO NH BS HS", LAYER_LIST, "vLLM FlashInfer (HND)")
    NL_X_NB_BS_HS = _f(
        "NB BS HS", LAYER_LIST, "vLLM MLA; indexer key-only caches; compressed pools"
    )
    NB_NL_TWO_BS_NH_HS = _f("NB NL TWO BS NH HS", CROSS_LAYER, "vLLM cross-layer layout")
    NB_NL_TWO_NH_BS_HS = _f("NB NL TWO NH BS HS", CROSS_LAYER, "TRT-LLM pool")
    TWO_X_NL_X_NB_BS_NH_HS = _f("NB BS NH HS", KV_LIST, "SGLang MHA")
    NL_X_NB_NH_BS_CS = _f("NB NH BS CS", LAYER_LIST, "vLLM unified K/V per head (HND)")
    NL_X_NB_BS_NH_CS = _f("NB BS NH CS", LAYER_LIST, "vLLM unified K/V per head (NHD)")
    NL_X_NB_BSV_BSS = _f("NB BS BSV_BSS", LAYER_LIST, "DeepSeek-V3.2 / GLM-5 indexer cache")
    NB_NL_NH_BS_CS = _f("NB NL NH BS CS", CROSS_LAYER, "vLLM blocks-first cross-layer pools (HND)")
    NB_NL_BS_NH_CS = _f("NB NL BS NH CS", CROSS_LAYER, "vLLM blocks-first cross-layer pools (NHD)")
    # --- JAX serving engines -----------------------------------------------------------
    NL_X_NB_BS_NH_TWO_HS = _f(
        "NB BS NH TWO HS", LAYER_LIST, "tpu-inference / sglang-jax (K/V interleaved on heads)"
    )
    TWO_X_NL_X_NH_NB_BS_HS = _f("NH NB BS HS", KV_LIST, "MaxText paged attention")
    # --- nice to have ------------------------------------------------------------------
    NL_X_TWO_NB_NH_ONE_BS_HS = _f("TWO NB NH ONE BS HS", LAYER_LIST, "vLLM-RBLN", must_have=False)
    NL_X_TWO_X_NB_BS_NH_HS = _f("NB BS NH HS", LAYER_PAIR_LIST, "vLLM-Ascend", must_have=False)
    TWO_X_NL_X_NBBS_NH_HS = _f(
        "PBS NH HS", KV_LIST, "SGLang (page-folded)", groupable=False, must_have=False
    )
    NL_X_NBBS_ONE_HS = _f(
        "PBS ONE HS", LAYER_LIST, "SGLang MLA (page-folded)", groupable=False, must_have=False
    )
    # --- recurrent state (one whole state per slot; docs/SEMANTICS.md section 9) ---------
    NL_X_NB_CD_CW = _f(
        "NB CD CW",
        LAYER_LIST,
        "conv state, DS (vLLM DS layout, SGLang, sglang-jax)",
        must_have=False,
        recurrent_state=True,
    )
    NL_X_NB_CW_CD = _f(
        "NB CW CD",
        LAYER_LIST,
        "conv state, SD (vLLM default layout)",
        must_have=False,
        recurrent_state=True,
    )
    NL_X_NB_SH_SS = _f(
        "NB SH SS",
        LAYER_LIST,
        "temporal state (Mamba1/Mamba2 SSM, GDN delta memory)",
        must_have=False,
        recurrent_state=True,
    )

    @property
    def facts(self) -> FormatFacts:
        return self.value

    @property
    def kv_size(self) -> int:
        return self.value.kv_size

    @property
    def is_mla(self) -> bool:
        return self.value.is_mla

    @property
    def is_hnd(self) -> bool:
        return self.value.is_hnd

    @property
    def is_cross_layer(self) -> bool:
        return self.value.is_cross_layer

    @property
    def is_kv_list(self) -> bool:
        return self.value.is_kv_list

    @property
    def is_layer_list(self) -> bool:
        return self.value.is_layer_list

    @property
    def is_fused_packed(self) -> bool:
        return self.value.is_fused_packed

    @property
    def is_indexer(self) -> bool:
        return self.value.is_indexer

    @property
    def block_axis_first(self) -> bool:
        return self.value.block_axis_first

    @property
    def groupable(self) -> bool:
        return self.value.groupable

    @property
    def is_recurrent_state(self) -> bool:
        """A recurrent-state format (conv or temporal state, one whole state per slot)."""
        return self.value.recurrent_state

    @property
    def must_have(self) -> bool:
        return self.value.must_have

    def __repr__(self) -> str:
        return f"EngineKVFormat.{self.name}"


MUST_HAVE_FORMATS = tuple(f for f in EngineKVFormat if f.must_have)
STATE_FORMATS = tuple(f for f in EngineKVFormat if f.is_recurrent_state)
