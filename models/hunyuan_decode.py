"""A lean greedy decode loop for HunYuanVL: one prefill through the model, then graphed steps.

Why not `model.generate()`: its decode step costs ~70-90 ms on an H200 at every batch size, all
of it host time (Python, a DynamicCache that grows by `torch.cat`, per-step masks, logits
processors, a host sync per step); the memory-bandwidth floor of that step is ~4 ms at batch 128.
This loop keeps the model's own vision tower and attention arithmetic, takes the multimodal RoPE
positions each row brings from the engine's preprocessing, runs the text prefill with fused
norm/RoPE kernels when the step does (`_prefill_fused`), and replaces the decode steps:

* the prefill's KV cache moves layer by layer into a static cache sized prompt + new tokens,
  so the peak stays the prefill's until that cache outgrows it (models/costs.py);
* after the prompt every RoPE axis carries the same text position, so each row's position is its
  last prompt position + 1 + step, advanced on the device (no recomputation of mrope indices);
* a step calls the model's own submodules (norms, projections, MLP, lm_head) with the same
  float arithmetic as transformers for RoPE, so outputs match the plain path; attention reads
  each row's real keys once (`models.decode_attention`);
* greedy argmax, the min-new-tokens eos ban, finished rows forced to pad, the step counters:
  all on the device, so one step is captured in a CUDA graph per batch and replayed with no
  host sync except a check for "all rows finished" every `CHECK_EVERY` steps.

A graph is captured per batch rather than cached across batches: the KV cache it points at is
then allocated and freed with its batch, as the planner's memory model assumes, and a capture
costs one step's host time (tens of ms) against hundreds of replayed steps.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from models.decode_attention import (
    DEFAULT_CONFIG,
    KernelConfig,
    TritonDecodeAttention,
    attend_torch,
    triton_available,
)
from models.decode_kernels import add_rms_norm, rope_rms_norm

if TYPE_CHECKING:
    import torch

CHECK_EVERY = 16  # steps between host checks for "every row has finished"
PADDED_ROWS = 8  # rows per attention call of a padded prefill (see `_padded_attention`)
DECODE_MODES = ("fast", "generate")
ATTENTION_MODES = ("auto", "triton", "torch")


def unsupported_reason(gen: Any) -> str | None:
    """Why the fast loop cannot reproduce `generate()` under this generation config, or None.

    The loop implements greedy search with eos/pad handling and min_new_tokens only; any other
    logits processor (a checkpoint may ship a repetition penalty, say) sends the batch to the
    plain path instead of silently changing the output.
    """
    if getattr(gen, "do_sample", False):
        return "sampling"
    if (getattr(gen, "num_beams", 1) or 1) != 1:
        return "beam search"
    for name, neutral in (
        ("repetition_penalty", 1.0),
        ("encoder_repetition_penalty", 1.0),
        ("no_repeat_ngram_size", 0),
        ("min_length", 0),
        ("guidance_scale", 1.0),
    ):
        value = getattr(gen, name, None)
        if value not in (None, neutral):
            return f"{name}={value}"
    for name in (
        "bad_words_ids", "suppress_tokens", "begin_suppress_tokens", "forced_bos_token_id",
        "forced_eos_token_id", "sequence_bias", "exponential_decay_length_penalty",
        "stop_strings", "watermarking_config", "force_words_ids", "constraints",
    ):
        if getattr(gen, name, None):
            return name
    return None


@dataclass
class DecodeStats:
    """Where one batch's time went (seconds), and how its steps ran."""

    prefill_s: float = 0.0
    decode_s: float = 0.0
    capture_s: float = 0.0
    steps: int = 0  # decode steps run after the prefill (new tokens - 1 unless all finished)
    timed_steps: int = 0  # steps inside decode_s (a graph's first step runs within capture_s)
    graph: bool = False
    attention: str = "torch"
    fused: bool = False
    cache_len: int = 0
    prefill_peak_bytes: int = 0  # device memory allocated at most up to the prefill's end (CUDA)


@dataclass
class _State:
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
    keys: list[torch.Tensor]  # per layer (B, KVH, L, D)
    values: list[torch.Tensor]
    prompt: int  # padded prompt length: the first decode slot
    host_len: int  # keys visible at the next step, tracked on the host for eager slicing
    full_cache: bool  # attend over the whole static cache (graph) instead of a slice
    track_valid: bool = True  # keep `valid` current (only the torch attention reads it)
    logits: list[torch.Tensor] | None = field(default=None)


class HunyuanDecoder:
    """The fast decode path for one loaded HunYuanVLForConditionalGeneration."""

    def __init__(
        self,
        model: Any,
        *,
        eos_ids: set[int],
        pad_id: int,
        use_graph: bool | None = None,
        attention: str = "auto",
        fused: bool | None = None,
        kernel: KernelConfig = DEFAULT_CONFIG,
    ) -> None:
        """`fused` (default: with Triton attention) replaces transformers' RMSNorm and RoPE
        modules by the kernels of models.decode_kernels inside the step."""
        import torch

        if attention not in ATTENTION_MODES:
            raise ValueError(f"attention must be one of {ATTENTION_MODES}, not {attention!r}")
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
        self.is_cuda = self.device.type == "cuda"
        self.use_graph = self.is_cuda if use_graph is None else use_graph
        if attention == "auto":
            attention = "triton" if self.is_cuda and triton_available() else "torch"
        self.attention = attention
        self.fused = attention == "triton" if fused is None else fused
        self.kernel = kernel
        self.eos = torch.tensor(sorted(eos_ids), dtype=torch.long, device=self.device)
        self.pad_id = pad_id

        # RoPE: which position axis drives each rotary dimension. transformers builds cos/sin
        # per axis, concatenates (freq, freq) and takes chunk i (2 * section[i] wide) from axis i;
        # gathering the axis per dimension gives the same numbers without the per-axis tensors.
        rotary = lm.rotary_emb
        sections = list(rotary.mrope_section or [])
        self.axes = max(1, len(sections))
        axis_of_dim: list[int] = []
        for i, width in enumerate(sections):
            axis_of_dim += [i % self.axes] * (2 * int(width))
        if not sections:
            axis_of_dim = [0] * self.head_dim
        if len(axis_of_dim) != self.head_dim:
            raise ValueError(f"mrope sections {sections} do not cover head_dim {self.head_dim}")
        self.axis_of_dim = torch.tensor(axis_of_dim, dtype=torch.long, device=self.device)
        inv = rotary.inv_freq.to(device=self.device, dtype=torch.float32)
        self.inv_full = torch.cat((inv, inv))
        self.rope_scaling = float(rotary.attention_scaling)

    # -- one batch ---------------------------------------------------------------------------

    def generate(
        self,
        inputs: dict[str, torch.Tensor],
        *,
        max_new_tokens: int,
        min_new_tokens: int | None = None,
        output_logits: bool = False,
        position_offset: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor | None, DecodeStats]:
        """Greedy tokens (B, steps) on the CPU, raw logits (B, steps, V) if asked, and stats.

        `inputs` are the collated model inputs on the model's device. `position_offset` shifts
        every decode position: tests use it to show that a wrong RoPE position is caught.
        """
        import torch

        stats = DecodeStats(attention=self.attention, fused=self.fused)
        n_new = max_new_tokens
        min_new = min_new_tokens or 0
        t0 = time.perf_counter()
        with torch.inference_mode():
            state, first_logits = self._prefill(inputs, n_new, position_offset)
            self._choose_first(state, first_logits, min_new)
            if output_logits:
                state.logits = [first_logits.float()]
            del first_logits
            if self.is_cuda:
                torch.cuda.synchronize(self.device)
                stats.prefill_peak_bytes = int(torch.cuda.max_memory_allocated(self.device))
            t1 = time.perf_counter()
            stats.prefill_s = t1 - t0
            stats.cache_len = int(state.keys[0].shape[2]) if state.keys else 0
            steps = self._decode(state, n_new, min_new, output_logits, stats)
            tokens = state.out[:, : steps + 1].cpu()
            stats.steps = steps
            stats.decode_s = time.perf_counter() - t1 - stats.capture_s
            logits = torch.stack(state.logits, dim=1).cpu() if state.logits else None
        return tokens, logits, stats

    def _prefill(
        self, inputs: dict[str, torch.Tensor], n_new: int, offset: int
    ) -> tuple[_State, torch.Tensor]:
        """Run the prompt through the model; move its KV cache into a static one."""
        import torch

        ids = inputs["input_ids"]
        mask = inputs["attention_mask"]
        batch, prompt = ids.shape
        inputs = dict(inputs)
        positions = inputs.pop("position_ids", None)  # the engine's collate brings them
        if positions is None:
            positions, _ = self.model.model.get_rope_index(
                ids,
                mm_token_type_ids=inputs["mm_token_type_ids"],
                image_grid_thw=inputs.get("image_grid_thw"),
                attention_mask=mask,
            )
        if self.fused:
            prompt_kv, first_logits = self._prefill_fused(inputs, positions)
        else:
            prompt_kv, first_logits = self._prefill_model(inputs, positions)

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
        state = _State(
            tok=torch.full((batch,), self.pad_id, dtype=torch.long, device=ids.device),
            pos=(positions[:, :, -1] + 1 + offset).contiguous(),
            slot=torch.tensor([prompt], dtype=torch.long, device=ids.device),
            end=torch.tensor([prompt + 1], dtype=torch.int32, device=ids.device),
            kidx=torch.tensor([0], dtype=torch.long, device=ids.device),
            start=start,
            valid=valid,
            finished=torch.zeros(batch, dtype=torch.bool, device=ids.device),
            out=torch.full((batch, n_new), self.pad_id, dtype=torch.long, device=ids.device),
            keys=keys,
            values=values,
            prompt=prompt,
            host_len=prompt + 1,
            full_cache=False,
        )
        return state, first_logits

    def _prefill_model(
        self, inputs: dict[str, torch.Tensor], positions: torch.Tensor
    ) -> tuple[list[Any], torch.Tensor]:
        """The model's own forward over the prompt: per-layer (keys, values) of the prompt as
        (B, kv_heads, L, D), and the last position's logits."""
        out = self.model(**inputs, position_ids=positions, use_cache=True, logits_to_keep=1)
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

    def _prefill_fused(
        self, inputs: dict[str, torch.Tensor], positions: torch.Tensor
    ) -> tuple[list[Any], torch.Tensor]:
        """The text prefill with the decode step's fused kernels; same outputs as
        `_prefill_model`.

        Why: transformers' text layers spend most of their prefill time outside the matmuls and
        the attention: RMSNorm, RoPE and the q/k norms as ~30 float32 elementwise kernels a
        layer over every prompt token (bench/results/prefill_profile_h200*.md). Here they are
        the three Triton kernels of models.decode_kernels, with transformers' rounding points.
        The vision tower, the image scatter and the attention kernel are the library's; so is
        the attention mask (causal, left padding; see `_padded_attention`).
        """
        import torch
        import torch.nn.functional as F

        ids = inputs["input_ids"]
        mask = inputs["attention_mask"]
        batch, prompt = ids.shape
        n = batch * prompt
        inner = self.model.model
        h = self.embed(ids)
        pixels = inputs.get("pixel_values")
        if pixels is not None:
            feats = inner.get_image_features(
                pixels, inputs["image_grid_thw"], return_dict=True
            ).pooler_output
            if isinstance(feats, (list, tuple)):
                feats = torch.cat(list(feats), dim=0)
            image = (ids == inner.config.image_token_id)[..., None].expand_as(h)
            h = h.masked_scatter(image, feats.to(h.device, h.dtype))
            del feats, image
        h = h.reshape(n, -1)
        cos, sin = self._rope(positions.reshape(positions.shape[0], n))
        cos = cos[:, 0].float().contiguous()
        sin = sin[:, 0].float().contiguous()
        # Left padding: the causal mask per row, built once for every layer.
        allowed = None if bool(mask.bool().all()) else _padded_causal_mask(mask.bool())
        groups = self.heads // self.kv_heads
        prompt_kv: list[Any] = []
        pending: torch.Tensor | None = None
        for layer in self.layers:
            attn = layer.self_attn
            norm = layer.input_layernorm
            h, x = add_rms_norm(h, pending, norm.weight, norm.variance_epsilon)
            q = attn.q_proj(x).view(n, self.heads, self.head_dim)
            k = attn.k_proj(x).view(n, self.kv_heads, self.head_dim)
            v = attn.v_proj(x).view(batch, prompt, self.kv_heads, self.head_dim).transpose(1, 2)
            qn, kn = attn.query_layernorm, attn.key_layernorm
            q = rope_rms_norm(q, cos, sin, qn.weight, qn.variance_epsilon)
            k = rope_rms_norm(k, cos, sin, kn.weight, kn.variance_epsilon)
            k = k.view(batch, prompt, self.kv_heads, self.head_dim).transpose(1, 2)
            q = q.view(batch, prompt, self.heads, self.head_dim).transpose(1, 2)
            if allowed is not None:
                o = self._padded_attention(q, k, v, allowed, groups)
            else:  # what transformers' sdpa integration does without padding
                o = F.scaled_dot_product_attention(
                    q, k, v, is_causal=True, scale=self.scale, enable_gqa=groups > 1
                )
            prompt_kv.append((k, v))
            o = o.transpose(1, 2).reshape(n, self.heads * self.head_dim)
            post = layer.post_attention_layernorm
            h, x = add_rms_norm(h, attn.o_proj(o), post.weight, post.variance_epsilon)
            pending = layer.mlp(x)
        assert pending is not None
        last = slice(prompt - 1, n, prompt)  # each row's last position
        _, x = add_rms_norm(h[last], pending[last], self.norm.weight, self.norm.variance_epsilon)
        return prompt_kv, self.lm_head(x)

    def _padded_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: Any, groups: int,
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
                q[lo:hi], _repeat_kv(k[lo:hi], groups), _repeat_kv(v[lo:hi], groups),
                attn_mask=allowed(lo, hi), scale=self.scale,
            )
        return out

    def _contiguous_rows(self, state: _State, prompt: int) -> bool:
        """True when every row's real keys are one run ending at the prompt's end (left padding),
        the layout the Triton kernel assumes; anything else takes the torch attention."""
        real = state.valid[:, :prompt].sum(-1)
        return bool(((prompt - state.start.long()) == real).all())

    def _choose_first(self, state: _State, logits: torch.Tensor, min_new: int) -> None:
        nxt = self._select(logits, state, min_new)
        state.out[:, 0] = nxt
        state.finished |= (nxt[:, None] == self.eos[None, :]).any(1)
        state.tok.copy_(nxt)
        state.kidx += 1

    def _select(self, logits: torch.Tensor, state: _State, min_new: int) -> torch.Tensor:
        """Greedy choice as transformers makes it: float32 scores, eos banned before min_new,
        finished rows get pad."""
        import torch

        scores = logits.float()
        if min_new > 0:
            banned = state.kidx < min_new  # (1,) bool, stays on the device
            eos_scores = scores.index_select(1, self.eos)
            scores = scores.index_copy(
                1, self.eos, torch.where(banned, torch.full_like(eos_scores, float("-inf")),
                                         eos_scores)
            )
        nxt = scores.argmax(-1)
        return torch.where(state.finished, torch.full_like(nxt, self.pad_id), nxt)

    def _decode(
        self, state: _State, n_new: int, min_new: int, keep_logits: bool, stats: DecodeStats
    ) -> int:
        """Run decode steps 1..n_new-1 (step j feeds token j-1 and produces token j)."""
        import torch

        total = n_new - 1
        if total <= 0:
            return 0
        attend = self._attention_fn(state, state.prompt)
        graph = self.use_graph and self.is_cuda and not keep_logits and total >= 2
        stats.graph = graph
        state.full_cache = graph
        if not graph:
            for done in range(total):
                if done % CHECK_EVERY == 0 and done and bool(state.finished.all()):
                    stats.timed_steps = done
                    return done
                self._step(state, attend, min_new)
            stats.timed_steps = total
            return total

        t = time.perf_counter()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._step(state, attend, min_new)  # step 1, eagerly: also warms up the kernels
        torch.cuda.current_stream(self.device).wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, capture_error_mode="thread_local"):
            self._step(state, attend, min_new)  # recorded, not run
        torch.cuda.synchronize(self.device)
        stats.capture_s = time.perf_counter() - t
        done = 1
        while done < total:
            if done % CHECK_EVERY == 0 and bool(state.finished.all()):
                break
            g.replay()
            done += 1
        torch.cuda.synchronize(self.device)
        del g
        stats.timed_steps = done - 1
        return done

    def _attention_fn(self, state: _State, prompt: int) -> Any:
        if self.attention == "triton" and self._contiguous_rows(state, prompt):
            state.track_valid = False
            kernel = TritonDecodeAttention(
                state.out.shape[0], self.heads, self.kv_heads, self.head_dim,
                state.keys[0].shape[2], self.device, self.kernel,
            )

            def triton_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                return kernel(q, k, v, state.start, state.end, self.scale)

            return triton_attend

        def torch_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if state.full_cache:
                return attend_torch(q, k, v, state.valid, self.scale)
            n = state.host_len
            return attend_torch(q, k[:, :, :n], v[:, :, :n], state.valid[:, :n], self.scale)

        return torch_attend

    def _rope(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (B, 1, D) for positions (axes, B), rounded to the model dtype as
        transformers does before applying them in float32."""
        per_dim = pos.index_select(0, self.axis_of_dim).t().float()  # (B, D)
        freqs = per_dim * self.inv_full
        cos = (freqs.cos() * self.rope_scaling).to(self.dtype)
        sin = (freqs.sin() * self.rope_scaling).to(self.dtype)
        return cos[:, None, :], sin[:, None, :]

    def _step(self, state: _State, attend: Any, min_new: int) -> None:
        """One decode step over the static state; no host sync, no data-dependent Python."""
        if state.track_valid:
            state.valid.index_fill_(1, state.slot, True)
        logits = self._layers_fused(state, attend) if self.fused else self._layers(state, attend)
        if state.logits is not None:
            state.logits.append(logits.float())
        nxt = self._select(logits, state, min_new)
        state.out.index_copy_(1, state.kidx, nxt[:, None])
        state.finished |= (nxt[:, None] == self.eos[None, :]).any(1)
        state.tok.copy_(nxt)
        state.pos += 1
        state.slot += 1
        state.end += 1
        state.kidx += 1
        state.host_len += 1

    def _layers(self, state: _State, attend: Any) -> torch.Tensor:
        """The text decoder over one token per row, module by module: logits (B, V)."""
        batch = state.tok.shape[0]
        h = self.embed(state.tok)  # (B, hidden)
        cos, sin = self._rope(state.pos)
        cos, sin = cos.float(), sin.float()
        for li, layer in enumerate(self.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = attn.q_proj(x).view(batch, self.heads, self.head_dim)
            k = attn.k_proj(x).view(batch, self.kv_heads, self.head_dim)
            v = attn.v_proj(x).view(batch, self.kv_heads, self.head_dim)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            q = attn.query_layernorm(q)
            k = attn.key_layernorm(k)
            kc, vc = state.keys[li], state.values[li]
            kc.index_copy_(2, state.slot, k[:, :, None, :])
            vc.index_copy_(2, state.slot, v[:, :, None, :])
            o = attend(q, kc, vc)
            h = h + attn.o_proj(o.reshape(batch, self.heads * self.head_dim))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.lm_head(self.norm(h))  # (B, V)

    def _layers_fused(self, state: _State, attend: Any) -> torch.Tensor:
        """The same decoder with RMSNorm (+ residual add) and RoPE + q/k norm (+ KV write)
        fused: ~16 kernels per layer instead of ~64."""
        batch = state.tok.shape[0]
        cos, sin = self._rope(state.pos)
        cos = cos[:, 0].float().contiguous()
        sin = sin[:, 0].float().contiguous()
        h = self.embed(state.tok)
        pending: torch.Tensor | None = None  # the last sublayer's output, not yet added to h
        for li, layer in enumerate(self.layers):
            attn = layer.self_attn
            norm = layer.input_layernorm
            h, x = add_rms_norm(h, pending, norm.weight, norm.variance_epsilon)
            q = attn.q_proj(x).view(batch, self.heads, self.head_dim)
            k = attn.k_proj(x).view(batch, self.kv_heads, self.head_dim)
            v = attn.v_proj(x).view(batch, self.kv_heads, self.head_dim)
            qn, kn = attn.query_layernorm, attn.key_layernorm
            q = rope_rms_norm(q, cos, sin, qn.weight, qn.variance_epsilon)
            kc, vc = state.keys[li], state.values[li]
            rope_rms_norm(k, cos, sin, kn.weight, kn.variance_epsilon, cache=kc,
                          slot=state.slot, v=v, v_cache=vc)
            o = attend(q, kc, vc)
            post = layer.post_attention_layernorm
            h, x = add_rms_norm(h, attn.o_proj(o.reshape(batch, self.heads * self.head_dim)),
                                post.weight, post.variance_epsilon)
            pending = layer.mlp(x)
        h, x = add_rms_norm(h, pending, self.norm.weight, self.norm.variance_epsilon)
        return self.lm_head(x)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in float32, back to x's dtype: the arithmetic of transformers' apply_rotary_pos_emb."""
    import torch

    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return ((xf * cos) + (rotated * sin)).to(x.dtype)


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
    return x[:, :, None].expand(b, heads, groups, length, dim).reshape(b, heads * groups, length,
                                                                      dim)


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


def batch_vision_attention(model: Any, enabled: bool = True) -> None:
    """Run the vision tower's attention as one sdpa call per run of equal-sized images.

    transformers' sdpa path loops over the images of a batch, one sdpa call per image and layer
    (27 x batch calls, ~1 ms of host time each), which makes the prefill of a large batch
    host-bound. Consecutive images with the same patch count are strided views of one tensor, so
    they go through one call with a batch dimension: the same per-image arithmetic, no copies,
    no cross-image attention. Installed on this model's instances only; `enabled=False` restores
    the library's method (the bench measures both). Other attention implementations are left as
    they are.
    """
    import types

    tower = model.model.vision_tower
    if getattr(tower.config, "_attn_implementation", "sdpa") != "sdpa":
        return
    for layer in tower.layers:
        attn = layer.self_attn
        if not enabled:
            attn.__dict__.pop("forward", None)
            continue
        attn.forward = types.MethodType(_grouped_vision_attention, attn)


def _grouped_vision_attention(
    self: Any, hidden_states: torch.Tensor, cu_seqlens: torch.Tensor,
    max_seqlen: int | None = None, **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """HunYuanVLVisionAttention.forward for sdpa, batched over runs of equal-length images."""
    import torch
    import torch.nn.functional as F

    batch, seq, _ = hidden_states.shape
    heads, dim = self.num_heads, self.head_dim
    if batch != 1:
        raise ValueError(f"the vision tower packs images into one row, got {batch}")
    q = self.q_proj(hidden_states).view(seq, heads, dim)
    k = self.k_proj(hidden_states).view(seq, heads, dim)
    v = self.v_proj(hidden_states).view(seq, heads, dim)
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    outputs = []
    offset = 0
    i = 0
    while i < len(lengths):
        n = lengths[i]
        count = 1
        while i + count < len(lengths) and lengths[i + count] == n:
            count += 1
        span = slice(offset, offset + n * count)

        def images(x: torch.Tensor, span: slice = span, count: int = count, n: int = n
                   ) -> torch.Tensor:
            return x[span].view(count, n, heads, dim).transpose(1, 2)

        out = F.scaled_dot_product_attention(
            images(q), images(k), images(v), dropout_p=0.0, scale=self.scaling, is_causal=False
        )
        outputs.append(out.transpose(1, 2).reshape(count * n, heads * dim))
        offset += n * count
        i += count
    merged = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)
    return self.o_proj(merged.view(1, seq, heads * dim)), None


def decode_mode_from_env() -> str:
    """OCRQ_DECODE: "fast" (default) or "generate" (transformers' own loop)."""
    mode = os.environ.get("OCRQ_DECODE", "fast").strip().lower() or "fast"
    if mode not in DECODE_MODES:
        raise ValueError(f"OCRQ_DECODE must be one of {DECODE_MODES}, not {mode!r}")
    return mode


def attention_mode_from_env() -> str:
    """OCRQ_DECODE_ATTENTION: "auto" (Triton on CUDA when installed), "triton" or "torch"."""
    mode = os.environ.get("OCRQ_DECODE_ATTENTION", "auto").strip().lower() or "auto"
    if mode not in ATTENTION_MODES:
        raise ValueError(f"OCRQ_DECODE_ATTENTION must be one of {ATTENTION_MODES}, not {mode!r}")
    return mode
