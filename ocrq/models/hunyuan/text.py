"""HunYuanVL's text decoder as the fast loop drives it: its modules, its RoPE, one decode step.

Why not the model's forward: a step of one token per row through transformers' modules costs
~64 small kernels a layer plus the library's per-step Python; here the same modules (norms,
projections, MLP, lm_head) are called directly with transformers' float arithmetic, so outputs
match the plain path, and with `fused` the norms and RoPE become the Triton kernels of
ocrq/models/hunyuan/kernels.py and the projections are merged (merged.py): ~12 kernels a layer.
The step's attention is handed in (`attend`): the decode loop picks the Triton kernel or the
torch reference per batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ocrq.models.hunyuan.fidelity import axis_of_dim, rope_layout_of
from ocrq.models.hunyuan.kernels import add_rms_norm, rope_rms_norm, silu_mul
from ocrq.models.hunyuan.kv_cache import store
from ocrq.models.hunyuan.merged import merge_linears

if TYPE_CHECKING:
    import torch

    from ocrq.models.hunyuan.vision_attention import VarlenKernel

# The fused step's merged projections (ocrq/models/hunyuan/merged.py). A constant, not a
# setting: bench/loop_profile.py flips it (--merged off) to time both in one call.
MERGED_PROJECTIONS = True


class TextModel:
    """The loaded model's text decoder: modules, shapes and RoPE tables, read once."""

    def __init__(self, model: Any) -> None:
        import torch

        self.model = model
        lm = model.model.language_model
        cfg = model.config.text_config
        self.embed = lm.embed_tokens
        self.layers = list(lm.layers[: cfg.num_hidden_layers])
        self.norm = lm.norm
        self.lm_head = model.lm_head
        first = self.layers[0].self_attn
        self.head_dim = int(first.head_dim)
        self.heads = int(cfg.num_attention_heads)
        self.kv_heads = int(cfg.num_key_value_heads)
        self.scale = float(first.scaling)
        self.device = model.device
        self.dtype = model.dtype
        # The packed prefill's causal attention where the engine chose FlashAttention-4 for it
        # (`Settings.prefill_attention`); None: torch's flash varlen kernel, or SDPA per row.
        self.causal_kernel: VarlenKernel | None = None
        # The fused step's merged projections (ocrq/models/hunyuan/merged.py), made by `merge`:
        # at load by a decoder that runs the fused step (before the engine plans its memory, as
        # when they were made here), else at a first fused step; the CPU engine, which never
        # runs one, never copies those weights.
        self.qkv: list[torch.Tensor | None] | None = None
        self.gate_up: list[torch.Tensor | None] | None = None

        # RoPE: which position axis drives each rotary dimension, in the layout installed on
        # this model instance (ocrq/models/hunyuan/fidelity.py: the training code's by default,
        # transformers' on request), so these paths and the model's own forward agree.
        rotary = lm.rotary_emb
        sections = list(rotary.mrope_section or [])
        self.axes = max(1, len(sections))
        self.rope_layout = rope_layout_of(model)
        self.axis_of_dim = torch.tensor(
            axis_of_dim(sections, self.head_dim, self.rope_layout),
            dtype=torch.long,
            device=self.device,
        )
        inv = rotary.inv_freq.to(device=self.device, dtype=torch.float32)
        self.inv_full = torch.cat((inv, inv))
        self.rope_scaling = float(rotary.attention_scaling)

    def rope(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (B, 1, D) for positions (axes, B), rounded to the model dtype as
        transformers does before applying them in float32."""
        per_dim = pos.index_select(0, self.axis_of_dim).t().float()  # (B, D)
        freqs = per_dim * self.inv_full
        cos = (freqs.cos() * self.rope_scaling).to(self.dtype)
        sin = (freqs.sin() * self.rope_scaling).to(self.dtype)
        return cos[:, None, :], sin[:, None, :]

    def step(
        self,
        tok: torch.Tensor,
        pos: torch.Tensor,
        slot: torch.Tensor,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        attend: Any,
        fused: bool,
        pooled: bool = False,
    ) -> torch.Tensor:
        """Logits (B, V) for one token per row (`tok`, at RoPE positions `pos`), writing its
        keys and values into the static cache at column `slot`.

        `pooled`: the cache is one pool (1, KVH, T, D) shared by every row and `slot` (B,) is
        each row's own column in it (the running loop, ocrq/models/hunyuan/running.py)."""
        if fused:
            return self._layers_fused(tok, pos, slot, keys, values, attend, pooled)
        return self._layers(tok, pos, slot, keys, values, attend, pooled)

    def _layers(
        self,
        tok: torch.Tensor,
        pos: torch.Tensor,
        slot: torch.Tensor,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        attend: Any,
        pooled: bool = False,
    ) -> torch.Tensor:
        """The text decoder over one token per row, module by module."""
        batch = tok.shape[0]
        h = self.embed(tok)  # (B, hidden)
        cos, sin = self.rope(pos)
        cos, sin = cos.float(), sin.float()
        for li, layer in enumerate(self.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = attn.q_proj(x).view(batch, self.heads, self.head_dim)
            k = attn.k_proj(x).view(batch, self.kv_heads, self.head_dim)
            v = attn.v_proj(x).view(batch, self.kv_heads, self.head_dim)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
            q = attn.query_layernorm(q)
            k = attn.key_layernorm(k)
            kc, vc = keys[li], values[li]
            if pooled:  # row b's key at column slot[b] of the shared pool (maybe fp8)
                store(kc[0], 1, slot, k.transpose(0, 1))
                store(vc[0], 1, slot, v.transpose(0, 1))
            else:
                kc.index_copy_(2, slot, k[:, :, None, :])
                vc.index_copy_(2, slot, v[:, :, None, :])
            o = attend(q, kc, vc)
            h = h + attn.o_proj(o.reshape(batch, self.heads * self.head_dim))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.lm_head(self.norm(h))  # (B, V)

    def _layers_fused(
        self,
        tok: torch.Tensor,
        pos: torch.Tensor,
        slot: torch.Tensor,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        attend: Any,
        pooled: bool = False,
    ) -> torch.Tensor:
        """The same decoder with RMSNorm (+ residual add) and RoPE + q/k norm (+ KV write)
        fused (~16 kernels a layer instead of ~64), and q/k/v and gate/up as merged GEMMs (~12)."""
        import torch.nn.functional as F

        qkv, gate_ups = self.merge()
        batch = tok.shape[0]
        cos, sin = self.rope(pos)
        cos = cos[:, 0].float().contiguous()
        sin = sin[:, 0].float().contiguous()
        h = self.embed(tok)
        pending: torch.Tensor | None = None  # the last sublayer's output, not yet added to h
        for li, layer in enumerate(self.layers):
            attn = layer.self_attn
            norm = layer.input_layernorm
            h, x = add_rms_norm(h, pending, norm.weight, norm.variance_epsilon)
            q, k, v = self._qkv(qkv[li], attn, x)
            qn, kn = attn.query_layernorm, attn.key_layernorm
            q = rope_rms_norm(q, cos, sin, qn.weight, qn.variance_epsilon)
            kc, vc = keys[li], values[li]
            if pooled:  # the pool seen as one cache per row (batch stride 0), a column per row
                shape = (batch, *kc.shape[1:])
                rope_rms_norm(
                    k, cos, sin, kn.weight, kn.variance_epsilon,
                    cache=kc.expand(shape), slot=slot, v=v, v_cache=vc.expand(shape),
                )
            else:
                rope_rms_norm(
                    k, cos, sin, kn.weight, kn.variance_epsilon, cache=kc, slot=slot, v=v,
                    v_cache=vc,
                )
            o = attend(q, kc, vc)
            post = layer.post_attention_layernorm
            h, x = add_rms_norm(
                h,
                attn.o_proj(o.reshape(batch, self.heads * self.head_dim)),
                post.weight,
                post.variance_epsilon,
            )
            gate_up = gate_ups[li]
            if gate_up is None:
                pending = layer.mlp(x)
            else:
                pending = layer.mlp.down_proj(silu_mul(F.linear(x, gate_up)))
        h, x = add_rms_norm(h, pending, self.norm.weight, self.norm.variance_epsilon)
        return self.lm_head(x)

    def merge(self) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
        """Each layer's merged q/k/v weight and its merged gate/up weight (silu only): None where
        a layer's modules cannot be merged (they then run one by one) or MERGED_PROJECTIONS is
        off. Made once; the modules' weights become views of them (merged.py)."""
        if self.qkv is None or self.gate_up is None:
            merge = MERGED_PROJECTIONS
            silu = str(getattr(self.model.config.text_config, "hidden_act", "")) == "silu"
            self.qkv = [
                merge_linears(a.q_proj, a.k_proj, a.v_proj) if merge else None
                for a in (layer.self_attn for layer in self.layers)
            ]
            self.gate_up = [
                merge_linears(m.gate_proj, m.up_proj) if merge and silu else None
                for m in (layer.mlp for layer in self.layers)
            ]
        return self.qkv, self.gate_up

    def _qkv(self, merged: torch.Tensor | None, attn: Any, x: torch.Tensor) -> tuple[Any, Any, Any]:
        """A layer's q (B, heads, D), k and v (B, KV heads, D) of the normalised rows `x`: one
        GEMM where `merged` (views into its output, unit stride along D), else three."""
        import torch.nn.functional as F

        batch, d = x.shape[0], self.head_dim
        if merged is None:
            return (attn.q_proj(x).view(batch, self.heads, d),
                    attn.k_proj(x).view(batch, self.kv_heads, d),
                    attn.v_proj(x).view(batch, self.kv_heads, d))
        out = F.linear(x, merged)
        nq, nk = self.heads * d, self.kv_heads * d
        return (out[:, :nq].view(batch, self.heads, d),
                out[:, nq:nq + nk].view(batch, self.kv_heads, d),
                out[:, nq + nk:].view(batch, self.kv_heads, d))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in float32, back to x's dtype: the arithmetic of transformers' apply_rotary_pos_emb."""
    import torch

    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return ((xf * cos) + (rotated * sin)).to(x.dtype)
