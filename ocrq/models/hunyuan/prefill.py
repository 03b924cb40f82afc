"""The fast loop's prefill: every row's prompt through the model, and the state it leaves.

Two ways, the same outputs: `prefill_model` is the model's own forward (vision tower, image
scatter, text layers); `prefill_fused` calls the same modules but runs the text layers' norms
and RoPE as the Triton kernels of the decode step. Both return each layer's prompt keys and
values, which `prefill` moves into a static cache one layer at a time (so the peak stays the
prefill's), next to the other device tensors the graphed decode step advances (`DecodeState`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ocrq.models.hunyuan.kernels import add_rms_norm, rope_rms_norm
from ocrq.models.hunyuan.text import TextModel
from ocrq.models.hunyuan.tokens import SpecialTokens

if TYPE_CHECKING:
    import torch

    from ocrq.models.hunyuan.inputs import HostLayout

PADDED_ROWS = 8  # rows per attention call of a padded prefill (see `_padded_attention`)


@dataclass
class DecodeState:
    """Device tensors one decode step reads and advances in place (fixed addresses: graphable)."""

    tok: torch.Tensor  # (B,) token fed to this step
    pos: torch.Tensor  # (axes, B) its RoPE position on every axis
    slot: torch.Tensor  # (1,) long: cache column this step writes
    end: torch.Tensor  # (1,) int32: slot + 1, keys visible this step
    kidx: torch.Tensor  # (1,) long: index of the token this step produces
    start: torch.Tensor  # (B,) int32: first real key per row (left padding)
    valid: torch.Tensor  # (B, L) bool: keys a row may see (torch attention)
    finished: torch.Tensor  # (B,) bool
    out: torch.Tensor  # (B, N) long: generated tokens, pad-filled
    eos: torch.Tensor  # (E,) long: the token ids that end a row
    pad: int  # what finished rows get
    keys: list[torch.Tensor]  # per layer (B, KVH, L, D)
    values: list[torch.Tensor]
    prompt: int  # padded prompt length: the first decode slot
    host_len: int  # keys visible at the next step, tracked on the host for eager slicing
    full_cache: bool  # attend over the whole static cache (graph) instead of a slice
    track_valid: bool = True  # keep `valid` current (only the torch attention reads it)
    logits: list[torch.Tensor] | None = field(default=None)
    scores: list[torch.Tensor] | None = field(default=None)  # after the penalty, when kept
    # Repetition penalty (ocrq/models/hunyuan/repetition.py): 1.0 = none, and then no history.
    penalty: float = 1.0
    history: torch.Tensor | None = None  # (B, L + N) long: every row's own tokens so far
    hidx: torch.Tensor | None = None  # (1,) long: history column of the token chosen next
    stopped: torch.Tensor | None = None  # (B,) long: tokens a guard-stopped row kept, else 0
    # A bench's hooks only (ocrq/models/hunyuan/hooks.py): (B,) long, the token index at which
    # each row takes eos as if the model chose it; past `out`'s width for rows they leave alone.
    eos_at: torch.Tensor | None = None


def prefill(
    text: TextModel,
    inputs: dict[str, torch.Tensor],
    tokens: SpecialTokens,
    n_new: int,
    *,
    fused: bool,
    penalty: float = 1.0,
) -> tuple[DecodeState, torch.Tensor]:
    """Run the prompt through the model, move its KV cache into a static one sized for `n_new`
    new tokens, and lay out the state the first decode step reads; also the logits (B, V) the
    first new token is chosen from. With a repetition `penalty`, the rows' token history."""
    import torch

    from ocrq.models.hunyuan.repetition import history_of

    ids = inputs["input_ids"]
    mask = inputs["attention_mask"]
    batch, prompt = ids.shape
    inputs = dict(inputs)
    positions = inputs.pop("position_ids", None)  # the engine's collate brings them
    if positions is None:
        positions, _ = text.model.model.get_rope_index(
            ids,
            mm_token_type_ids=inputs["mm_token_type_ids"],
            image_grid_thw=inputs.get("image_grid_thw"),
            attention_mask=mask,
        )
    prompt_kv, first_logits = prompt_pass(text, inputs, positions, fused)

    cache_len = prompt + max(n_new - 1, 0)  # the last new token is never fed back
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    for index in range(len(prompt_kv)):
        k_dyn, v_dyn = prompt_kv[index]
        shape = (batch, k_dyn.shape[1], cache_len, k_dyn.shape[3])
        k = torch.empty(shape, dtype=k_dyn.dtype, device=k_dyn.device)
        v = torch.empty(shape, dtype=v_dyn.dtype, device=v_dyn.device)
        k[:, :, :prompt].copy_(k_dyn)
        v[:, :, :prompt].copy_(v_dyn)
        # Zeros, not garbage, past the prompt: the graphed torch attention reads them masked
        # and 0 * NaN would still be NaN.
        k[:, :, prompt:].zero_()
        v[:, :, prompt:].zero_()
        keys.append(k)
        values.append(v)
        del k_dyn, v_dyn
        prompt_kv[index] = None  # type: ignore[call-overload]  # free the layer now
    del prompt_kv

    valid = torch.zeros(batch, cache_len, dtype=torch.bool, device=ids.device)
    valid[:, :prompt] = mask.bool()
    start = mask.int().argmax(-1).to(torch.int32)  # first real column (left padding)
    state = DecodeState(
        tok=torch.full((batch,), tokens.pad, dtype=torch.long, device=ids.device),
        pos=(positions[:, :, -1] + 1).contiguous(),  # every axis: the text position
        slot=torch.tensor([prompt], dtype=torch.long, device=ids.device),
        end=torch.tensor([prompt + 1], dtype=torch.int32, device=ids.device),
        kidx=torch.tensor([0], dtype=torch.long, device=ids.device),
        start=start,
        valid=valid,
        finished=torch.zeros(batch, dtype=torch.bool, device=ids.device),
        out=torch.full((batch, n_new), tokens.pad, dtype=torch.long, device=ids.device),
        eos=torch.tensor(tokens.eos_list, dtype=torch.long, device=ids.device),
        pad=tokens.pad,
        keys=keys,
        values=values,
        prompt=prompt,
        host_len=prompt + 1,
        full_cache=False,
        penalty=penalty,
        stopped=torch.zeros(batch, dtype=torch.long, device=ids.device),
    )
    if penalty != 1.0:
        state.history = history_of(ids, mask, start, n_new)
        state.hidx = torch.tensor([prompt], dtype=torch.long, device=ids.device)
    return state, first_logits


def prompt_pass(
    text: TextModel,
    inputs: dict[str, torch.Tensor],
    positions: torch.Tensor,
    fused: bool,
    host: HostLayout | None = None,
) -> tuple[list[Any], torch.Tensor]:
    """Per-layer (keys, values) of the prompt as (B, kv_heads, L, D), and the logits (B, V) of
    each row's last position. With `host` (the fused path), without a host sync."""
    if fused:
        return prefill_fused(text, inputs, positions, host)
    return prefill_model(text, inputs, positions)


def prefill_model(
    text: TextModel, inputs: dict[str, torch.Tensor], positions: torch.Tensor
) -> tuple[list[Any], torch.Tensor]:
    """The model's own forward over the prompt: per-layer (keys, values) of the prompt as
    (B, kv_heads, L, D), and the last position's logits."""
    out = text.model(**inputs, position_ids=positions, use_cache=True, logits_to_keep=1)
    first_logits = out.logits[:, -1, :]
    cache = getattr(out, "cache", None)  # transformers >= 5.2x names it `cache`
    if cache is None:
        cache = getattr(out, "past_key_values", None)
    if cache is None:
        raise RuntimeError("the model returned no KV cache from its prefill")
    del out
    layers = [_cache_layer(cache, index) for index in range(_cache_depth(cache))]
    for index in range(len(layers)):
        _drop_layer(cache, index)  # the list holds the only references now
    return layers, first_logits


def prefill_fused(
    text: TextModel,
    inputs: dict[str, torch.Tensor],
    positions: torch.Tensor,
    host: HostLayout | None = None,
) -> tuple[list[Any], torch.Tensor]:
    """The text prefill with the decode step's fused kernels; same outputs as
    `prefill_model`.

    Why: transformers' text layers spend most of their prefill time outside the matmuls and
    the attention: RMSNorm, RoPE and the q/k norms as ~30 float32 elementwise kernels a
    layer over every prompt token (bench/results/prefill_profile/prefill_profile_h200*.md). Here
    they are the Triton kernels of ocrq/models/hunyuan/kernels.py, with transformers' rounding
    points. The vision tower, the image scatter and the attention kernel are the library's; so is
    the attention mask (causal, left padding; see `_padded_attention`).
    """
    import torch.nn.functional as F

    ids = inputs["input_ids"]
    mask = inputs["attention_mask"]
    batch, prompt = ids.shape
    n = batch * prompt
    inner = text.model.model
    h = text.embed(ids)
    pixels = inputs.get("pixel_values")
    if pixels is not None:
        if host is not None:  # the image tokens' places are known: no mask, no sync
            h = h.reshape(n, -1)
            place_images(text, h, pixels, host.grid, host.image_at)
        else:
            feats = image_features(text, pixels, inputs["image_grid_thw"])
            image = (ids == inner.config.image_token_id)[..., None].expand_as(h)
            h = h.masked_scatter(image, feats.to(h.device, h.dtype))
            del image, feats
    h = h.reshape(n, -1)
    # Left padding: the causal mask per row, built once for every layer.
    padded = host.padded if host is not None else not bool(mask.bool().all())
    allowed = _padded_causal_mask(mask.bool()) if padded else None
    groups = text.heads // text.kv_heads
    heads, kv_heads, dim = text.heads, text.kv_heads, text.head_dim

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[Any, Any]:
        k = k.view(batch, prompt, kv_heads, dim).transpose(1, 2)
        v = v.view(batch, prompt, kv_heads, dim).transpose(1, 2)
        q = q.view(batch, prompt, heads, dim).transpose(1, 2)
        if allowed is not None:
            o = _padded_attention(text, q, k, v, allowed, groups)
        else:  # what transformers' sdpa integration does without padding
            o = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=text.scale, enable_gqa=groups > 1
            )
        return o.transpose(1, 2).reshape(n, heads * dim), (k, v)

    positions = positions.reshape(positions.shape[0], n)
    last = slice(prompt - 1, n, prompt)  # each row's last position
    return text_layers(text, h, positions, attend, last, fused=True)


def image_features(text: TextModel, pixels: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """Every image's merged features through the library's vision tower, as one tensor."""
    import torch

    feats = text.model.model.get_image_features(pixels, grid, return_dict=True).pooler_output
    return torch.cat(list(feats), dim=0) if isinstance(feats, (list, tuple)) else feats


def place_images(text: TextModel, h: torch.Tensor, pixels: torch.Tensor, grid: torch.Tensor,
                 image_at: torch.Tensor) -> None:
    """Write the images' features into the flat (tokens, hidden) stream `h` at the image
    tokens' places, which the host computed: no mask, no sync."""
    feats = image_features(text, pixels, grid)
    h.index_copy_(0, image_at, feats.reshape(-1, h.shape[-1]).to(h.dtype))


def text_layers(
    text: TextModel,
    h: torch.Tensor,
    positions: torch.Tensor,
    attend: Any,
    last: Any,
    *,
    fused: bool,
) -> tuple[list[Any], torch.Tensor]:
    """The text decoder over a flat (tokens, hidden) prompt stream at RoPE `positions` (axes,
    tokens): per layer what `attend` keeps of the keys and values, and the logits of the
    tokens at `last`.

    `attend(q, k, v)` takes (tokens, heads, D) queries and (tokens, kv_heads, D) keys and
    values and returns the attention output (tokens, heads * D) and what the caller keeps of
    the layer's keys and values: the padded prefill and the packed one differ only there.
    `fused`: norms and RoPE as the Triton kernels of ocrq/models/hunyuan/kernels.py, else the
    model's modules with transformers' arithmetic (as `TextModel._layers`; the CPU)."""
    from ocrq.models.hunyuan.text import rotate

    n = h.shape[0]
    cos, sin = text.rope(positions)  # (n, 1, D)
    if fused:
        cos, sin = cos[:, 0].float().contiguous(), sin[:, 0].float().contiguous()
    else:
        cos, sin = cos.float(), sin.float()
    prompt_kv: list[Any] = []
    pending: torch.Tensor | None = None
    for layer in text.layers:
        attn = layer.self_attn
        qn, kn = attn.query_layernorm, attn.key_layernorm
        if fused:
            norm = layer.input_layernorm
            h, x = add_rms_norm(h, pending, norm.weight, norm.variance_epsilon)
        else:
            x = layer.input_layernorm(h)
        q = attn.q_proj(x).view(n, text.heads, text.head_dim)
        k = attn.k_proj(x).view(n, text.kv_heads, text.head_dim)
        v = attn.v_proj(x).view(n, text.kv_heads, text.head_dim)
        if fused:
            q = rope_rms_norm(q, cos, sin, qn.weight, qn.variance_epsilon)
            k = rope_rms_norm(k, cos, sin, kn.weight, kn.variance_epsilon)
        else:
            q, k = qn(rotate(q, cos, sin)), kn(rotate(k, cos, sin))
        o, kept = attend(q, k, v)
        prompt_kv.append(kept)
        o = attn.o_proj(o)
        post = layer.post_attention_layernorm
        if fused:
            h, x = add_rms_norm(h, o, post.weight, post.variance_epsilon)
            pending = layer.mlp(x)
        else:
            h = h + o
            h = h + layer.mlp(post(h))
    if not fused:
        return prompt_kv, text.lm_head(text.norm(h[last]))
    assert pending is not None
    _, x = add_rms_norm(h[last], pending[last], text.norm.weight, text.norm.variance_epsilon)
    return prompt_kv, text.lm_head(x)


def _padded_attention(
    text: TextModel,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: Any,
    groups: int,
) -> torch.Tensor:
    """Causal attention over left-padded rows, as transformers' sdpa integration computes it
    with a mask (key/value heads repeated, a boolean mask), `PADDED_ROWS` rows at a time.

    Why in slices: the mask (rows x L x L) and the repeated heads exist only for a slice, so
    a padded batch holds about what an unpadded one does, for which the cost model was
    measured; rows are independent, so each row's output is the same."""
    import torch
    import torch.nn.functional as F

    out = torch.empty_like(q)
    for lo in range(0, q.shape[0], PADDED_ROWS):
        hi = lo + PADDED_ROWS
        out[lo:hi] = F.scaled_dot_product_attention(
            q[lo:hi],
            _repeat_kv(k[lo:hi], groups),
            _repeat_kv(v[lo:hi], groups),
            attn_mask=allowed(lo, hi),
            scale=text.scale,
        )
    return out


def _padded_causal_mask(valid: torch.Tensor) -> Any:
    """For left-padded rows (valid: B x L), a function giving rows lo:hi's boolean attention
    mask (rows x 1 x L x L): causal, real keys only, and each padding row sees itself so that no
    row's softmax is empty (its output is never read)."""
    import torch

    prompt = valid.shape[1]
    cols = torch.arange(prompt, device=valid.device)
    causal = (cols[None, :] <= cols[:, None])[None, None]
    itself = torch.eye(prompt, dtype=torch.bool, device=valid.device)

    def rows(lo: int, hi: int) -> torch.Tensor:
        return (causal & valid[lo:hi, None, None, :]) | itself

    return rows


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, kv_heads, L, D) -> (B, kv_heads * groups, L, D), each key/value head repeated."""
    if groups == 1:
        return x
    b, heads, length, dim = x.shape
    return (
        x[:, :, None].expand(b, heads, groups, length, dim).reshape(b, heads * groups, length, dim)
    )


def _cache_depth(cache: Any) -> int:
    layers = getattr(cache, "layers", None)
    return len(layers) if layers is not None else len(cache.key_cache)


def _cache_layer(cache: Any, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys, values) of one layer of a transformers DynamicCache (5.x layers, or 4.x lists);
    fetched one at a time so that a copied layer can be freed before the next is copied."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return layers[index].keys, layers[index].values
    return cache.key_cache[index], cache.value_cache[index]


def _drop_layer(cache: Any, index: int) -> None:
    """Release one layer of the prefill cache as soon as it has been copied."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        layers[index].keys = layers[index].values = None
    else:
        cache.key_cache[index] = cache.value_cache[index] = None
