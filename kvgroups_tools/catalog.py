"""The shared catalogue of real model KV shapes (public model configs) for tests, the demo and
benchmarks.

Each entry builds a cache structure of :class:`~kvgroups_core.tensors.descriptors.TensorSpec` s (no
data), the per-layer formats and the engine group infos a manager needs. ``layers=`` shrinks a
model for CI while keeping its pattern (windows, groups, head geometry).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from kvgroups_core.formats.catalogue import EngineKVFormat as F
from kvgroups_core.tensors.descriptors import TensorSpec


@dataclass(frozen=True)
class CacheModel:
    """What a manager is built from: specs, formats per layer, engine group infos."""

    name: str
    kv_caches: Any
    formats: tuple[F, ...]
    engine_group_infos: tuple = ()
    block_size: int = 16
    notes: str = ""


@dataclass(frozen=True)
class ModelShape:
    """A catalogue entry: call :meth:`build` for a :class:`CacheModel`."""

    name: str
    summary: str
    layers: int
    builder: Callable[..., CacheModel] = field(repr=False)

    def build(
        self,
        *,
        num_blocks: int = 256,
        layers: int | None = None,
        dtype: str | None = None,
        fmt: F | None = None,
    ) -> CacheModel:
        return self.builder(
            num_blocks=num_blocks,
            layers=layers or self.layers,
            dtype=dtype,
            fmt=fmt,
            name=self.name,
        )


def _kv_spec(fmt: F, nb: int, bs: int, nh: int, hs: int, dtype: str) -> TensorSpec:
    """One per-layer K/V tensor of a layer-list format."""
    shapes = {
        F.NL_X_TWO_NB_BS_NH_HS: (2, nb, bs, nh, hs),
        F.NL_X_TWO_NB_NH_BS_HS: (2, nb, nh, bs, hs),
        F.NL_X_NB_TWO_BS_NH_HS: (nb, 2, bs, nh, hs),
        F.NL_X_NB_TWO_NH_BS_HS: (nb, 2, nh, bs, hs),
        F.NL_X_NB_BS_NH_TWO_HS: (nb, bs, nh, 2, hs),
    }
    return TensorSpec(shapes[fmt], dtype)


def _state_slots(num_blocks: int, bs: int, chunk: int = 256) -> int:
    """Snapshot slots for a cache of ``num_blocks`` attention blocks: one per chunk it holds
    (plus one, the engine's dummy slot)."""
    return max(2, num_blocks * bs // chunk + 1)


def _recurrent(
    conv: tuple[int, int],
    temporal: tuple[int, ...],
    projections: tuple,
    period: int,
    attn_heads: int,
    head_size: int,
    bs: int = 16,
    state_tokens: int = 256,
):
    """Recurrent layers (a conv state in vLLM's default "SD" orientation, bf16, and an fp32
    temporal state) with one full-attention layer every ``period`` layers (docs/SEMANTICS.md
    section 9). Each recurrent layer registers its conv then its temporal state; attention is
    engine group 0 (blocks of ``bs`` tokens), the states engine group 1, one snapshot slot per
    ``state_tokens`` tokens (a slot per 256-token chunk)."""

    def build(*, num_blocks, layers, dtype, fmt, name):
        from kvgroups_core.grouping.engine_groups import EngineGroupInfo

        fmt = fmt or F.NL_X_TWO_NB_BS_NH_HS
        attn = _kv_spec(fmt, num_blocks, bs, attn_heads, head_size, dtype or "bfloat16")
        slots = _state_slots(num_blocks, bs, state_tokens)
        conv_spec = TensorSpec((slots, conv[1], conv[0]), "bfloat16")  # (window, channels)
        temporal_spec = TensorSpec((slots,) + temporal, "float32")
        caches, formats, attn_layers, convs, temporals = [], [], [], [], []
        # Shrunk below one period, the last layer stays attention (the pattern's both kinds).
        attention = {i for i in range(layers) if i % period == period - 1} or {layers - 1}
        for layer in range(layers):
            if layer in attention:
                attn_layers.append(len(caches))
                caches.append(attn)
                formats.append(fmt)
            else:
                convs.append(len(caches))
                temporals.append(len(caches) + 1)
                caches += [conv_spec, temporal_spec]
                formats += [F.NL_X_NB_CW_CD, F.NL_X_NB_SH_SS]
        infos = [
            EngineGroupInfo(
                1, tuple(convs), state_tokens, recurrent_state=True, conv_projections=projections
            ),
            EngineGroupInfo(1, tuple(temporals), state_tokens, recurrent_state=True),
        ]
        if attn_layers:
            infos.append(EngineGroupInfo(0, tuple(attn_layers), bs))
        return CacheModel(
            name,
            caches,
            tuple(formats),
            tuple(infos),
            bs,
            notes=f"{len(convs)} recurrent layers, {slots} state slots",
        )

    return build


def _engine_infos(groups: list[tuple[int, list[int], int, int]]) -> tuple:
    """``(engine_group_id, layers, tokens_per_block, sw)`` rows ordered by first layer."""
    from kvgroups_core.grouping.engine_groups import EngineGroupInfo

    rows = sorted(groups, key=lambda g: g[1][0])
    return tuple(
        EngineGroupInfo(
            engine_group_id=g, layer_indices=tuple(ls), tokens_per_block=tpb, sw_size_tokens=sw
        )
        for g, ls, tpb, sw in rows
    )


def _dense(nh: int, hs: int, bs: int = 16, default_dtype: str = "bfloat16"):
    def build(*, num_blocks, layers, dtype, fmt, name):
        fmt = fmt or F.NL_X_TWO_NB_BS_NH_HS
        spec = _kv_spec(fmt, num_blocks, bs, nh, hs, dtype or default_dtype)
        return CacheModel(name, [spec] * layers, (fmt,) * layers, (), bs)

    return build


def _hybrid(nh: int, hs: int, window: int, period: int, bs: int = 16):
    """Sliding-window layers with one full-attention layer every ``period`` layers (engine
    group 0 = full attention, 1 = sliding window, as vLLM's hybrid allocator does)."""

    def build(*, num_blocks, layers, dtype, fmt, name):
        fmt = fmt or F.NL_X_TWO_NB_BS_NH_HS
        spec = _kv_spec(fmt, num_blocks, bs, nh, hs, dtype or "bfloat16")
        full = [i for i in range(layers) if i % period == period - 1]
        sliding = [i for i in range(layers) if i % period != period - 1]
        infos = _engine_infos(
            [(0, full, bs, -1), (1, sliding, bs, window)] if full else [(1, sliding, bs, window)]
        )
        return CacheModel(name, [spec] * layers, (fmt,) * layers, infos, bs)

    return build


def _mla(latent: int, bs: int, indexer: bool):
    """An MLA latent cache per layer; with ``indexer`` a key-only blocked-scale indexer cache
    per layer beside it, in the same engine group (layers NL..2NL-1)."""

    def build(*, num_blocks, layers, dtype, fmt, name):
        mla = TensorSpec((num_blocks, bs, latent), dtype or "bfloat16")
        caches = [mla] * layers
        formats = [F.NL_X_NB_BS_HS] * layers
        infos: tuple = ()
        if indexer:
            caches += [TensorSpec((num_blocks, bs, 132), "uint8")] * layers
            formats += [F.NL_X_NB_BSV_BSS] * layers
            infos = _engine_infos([(0, list(range(layers)), bs, -1)]) + _engine_infos(
                [(0, list(range(layers, 2 * layers)), bs, -1)]
            )
        return CacheModel(name, caches, tuple(formats), infos, bs)

    return build


def _v4_like(*, num_blocks, layers, dtype, fmt, name):
    """docs/SEMANTICS.md section 3's DeepSeek-V4-like mix: compression 4 and 128, a 64-token-block
    group and a 4-token-block fp32 group, each its own engine group."""
    caches = [
        TensorSpec((num_blocks, 64, 64), "float16"),
        TensorSpec((num_blocks, 2, 64), "float16"),
        TensorSpec((num_blocks, 64, 32), "float16"),
        TensorSpec((num_blocks, 4, 128), "float32"),
    ]
    infos = _engine_infos([(0, [0], 256, -1), (0, [1], 256, -1), (1, [2], 64, -1), (2, [3], 4, -1)])
    return CacheModel(name, caches, (F.NL_X_NB_BS_HS,) * 4, infos, 64)


def _hybrid_demo(*, num_blocks, layers, dtype, fmt, name):
    """gpt-oss-style attention (8 KV heads x 64; sliding window 128 and full attention
    alternate) plus a DeepSeek-style MLA latent group (576) in an engine group of its own.
    ``layers`` counts the attention layers; a quarter as many MLA layers follow them."""
    fmt = fmt or F.NL_X_TWO_NB_BS_NH_HS
    attn = _kv_spec(fmt, num_blocks, 16, 8, 64, dtype or "bfloat16")
    mla_layers = max(1, layers // 4)
    mla = TensorSpec((num_blocks, 16, 576), dtype or "bfloat16")
    caches = [attn] * layers + [mla] * mla_layers
    formats = (fmt,) * layers + (F.NL_X_NB_BS_HS,) * mla_layers
    full = [i for i in range(layers) if i % 2 == 1]
    sliding = [i for i in range(layers) if i % 2 == 0]
    infos = _engine_infos(
        [
            (1, sliding, 16, 128),
            (0, full, 16, -1),
            (2, list(range(layers, layers + mla_layers)), 16, -1),
        ]
    )
    return CacheModel(name, caches, formats, infos, 16)


MODELS: dict[str, ModelShape] = {
    m.name: m
    for m in (
        ModelShape(
            "hybrid-demo",
            "gpt-oss-style sliding (128) / full attention, 8 KV heads x 64, "
            "plus a DeepSeek-style MLA latent group (576), bf16",
            12,
            _hybrid_demo,
        ),
        ModelShape(
            "llama3-8b",
            "Llama-3-8B: 32 layers, 8 KV heads x 128, bf16, full attention",
            32,
            _dense(8, 128),
        ),
        ModelShape(
            "llama3-70b", "Llama-3-70B: 80 layers, 8 KV heads x 128, bf16", 80, _dense(8, 128)
        ),
        ModelShape("qwen3-32b", "Qwen3-32B: 64 layers, 8 KV heads x 128, bf16", 64, _dense(8, 128)),
        ModelShape(
            "small-pages", "1 KV head x 64, block 16, bf16 (small pages)", 32, _dense(1, 64)
        ),
        ModelShape(
            "deepseek-v3",
            "DeepSeek-V3/R1 MLA: 61 layers, latent 576, block 64, bf16",
            61,
            _mla(576, 64, indexer=False),
        ),
        ModelShape(
            "glm5-indexer",
            "DeepSeek-V3.2/GLM-5: MLA latent 576 + a 132-byte blocked-scale "
            "indexer cache per layer, one engine group",
            61,
            _mla(576, 64, indexer=True),
        ),
        ModelShape(
            "gemma3-27b",
            "Gemma-3-27B: 62 layers, 16 KV heads x 128, bf16, 5 sliding (window 1,024) : 1 full",
            62,
            _hybrid(16, 128, 1024, 6),
        ),
        ModelShape(
            "gpt-oss-120b",
            "gpt-oss-120b: 36 layers, 8 KV heads x 64, bf16, sliding (128) and full alternate",
            36,
            _hybrid(8, 64, 128, 2),
        ),
        ModelShape(
            "gpt-oss-20b",
            "gpt-oss-20b: 24 layers, 8 KV heads x 64, bf16, sliding (128) and full alternate",
            24,
            _hybrid(8, 64, 128, 2),
        ),
        ModelShape(
            "deepseek-v4-like",
            "DeepSeek-V4-like compressed mix (docs/SEMANTICS.md section 3)",
            4,
            _v4_like,
        ),
        # Recurrent-state hybrids (docs/SEMANTICS.md section 9), whole-model (TP=1) states.
        ModelShape(
            "qwen3-next-like",
            "Qwen3-Next-80B-like: 48 layers, Gated DeltaNet (conv "
            "(3, 8192) bf16 = Q|K|V of 16 key / 32 value heads x 128, delta memory "
            "(32, 128, 128) fp32) : full attention (2 KV heads x 256) = 3 : 1",
            48,
            _recurrent((8192, 3), (32, 128, 128), ((2048, 16), (2048, 16), (4096, 32)), 4, 2, 256),
        ),
        ModelShape(
            "nemotron-h-like",
            "NemotronH-8B-like: Mamba2 (conv (3, 10240) bf16 = x|B|C, 8 "
            "groups of state 128; SSM (128, 64, 128) fp32) with one attention layer (8 KV "
            "heads x 128) every 7 layers; 28 layers here (the MLP layers hold no cache)",
            28,
            _recurrent((10240, 3), (128, 64, 128), ((8192, 128), (1024, 8), (1024, 8)), 7, 8, 128),
        ),
        ModelShape(
            "jamba-like",
            "Jamba-v0.1-like: 32 layers, Mamba1 (conv (3, 8192) bf16, SSM "
            "(8192, 16) fp32) : attention (8 KV heads x 128) = 7 : 1",
            32,
            _recurrent((8192, 3), (8192, 16), ((8192, 8192),), 8, 8, 128),
        ),
    )
}


def get_model(name: str) -> ModelShape:
    from kvgroups_core.errors import KVGroupsValueError

    try:
        return MODELS[name]
    except KeyError:
        raise KVGroupsValueError(f"model: expected one of {sorted(MODELS)}, got {name!r}") from None
