"""Activation smoothing folded into the weights: a deployable lever against FP4's activation error.

SmoothQuant (Xiao et al., 2023) moves a linear input's per-channel outliers into its weight:
``y = (x / s) @ (W * s).T``. modelopt implements it for INT8 by keeping ``1 / s`` as a
``pre_quant_scale`` on the input quantizer, which a runtime must apply before every GEMM. Here the
factor is folded instead into what *produces* the input, so the exported checkpoint is a plain model
that any runtime loads with no extra op and the full-precision function is unchanged:

* ``attn_in``: q/k/v inputs, ``1 / s`` folded into the attention block's RMSNorm/LayerNorm gamma;
* ``mlp_in``: gate/up inputs, folded into the MLP block's norm gamma;
* ``mlp_down``: ``down_proj``'s input ``silu(gate) * up`` is linear in ``up``, so ``1 / s`` folds into
  ``up_proj``'s rows.

Factors follow SmoothQuant, ``s_j = max|x_j|^alpha / max|W_:,j|^(1 - alpha)``, with the activation
maxima measured on the calibration batches with every quantizer off. No library folds factors into
norms for NVFP4 QAT (modelopt's fold applies to AWQ's scales at HF export only), hence this module.
It runs once, before the first calibration; the checkpoint then holds the smoothed weights, so a
resumed run does not smooth again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from nemo_fp4qat.qat.calibration.batches import forward_batches
from nemo_fp4qat.qat.policy.rules import is_quantizer
from nemo_fp4qat.specs import optional_spec

__all__ = ["SITES", "SmoothingConfig", "SmoothingSite", "find_smoothing_sites", "smooth_model"]

SITES = ("attn_in", "mlp_in", "mlp_down")

# Per model family: site -> (producer path, consumer paths), relative to a decoder block. The producer
# is a norm (its gamma/beta take 1 / s) or, for ``mlp_down``, the linear whose rows feed the input.
_LAYOUTS: tuple[dict[str, tuple[str, tuple[str, ...]]], ...] = (
    {  # Hugging Face Llama / Mistral / Qwen2 / SmolLM
        "attn_in": ("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
        "mlp_in": ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
        "mlp_down": ("mlp.up_proj", ("mlp.down_proj",)),
    },
    {  # megatron-core local / modelopt spec: separate norms, fused qkv and gate|up
        "attn_in": ("input_layernorm", ("self_attention.linear_qkv",)),
        "mlp_in": ("pre_mlp_layernorm", ("mlp.linear_fc1",)),
        "mlp_down": ("mlp.linear_fc1", ("mlp.linear_fc2",)),
    },
)


@dataclass
class SmoothingConfig:
    """Which linear inputs to smooth, and how hard.

    Attributes:
        alpha: migration strength (0: nothing moves to the weights, 1: all of the activation's
            range does). 0.5 is SmoothQuant's default and what measured best here.
        sites: any of ``attn_in``, ``mlp_in``, ``mlp_down``. ``attn_in`` + ``mlp_in`` by default:
            the best NVFP4 PTQ measured on SmolLM2; adding ``mlp_down`` loses most of the gain
            (``benchmarks/results/levers.md``).
    """

    alpha: float = 0.5
    sites: tuple[str, ...] = ("attn_in", "mlp_in")

    def __post_init__(self) -> None:
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not 0 < self.alpha <= 1:
            raise ValueError(f"smoothing alpha must be in (0, 1], got {self.alpha!r} (SmoothQuant uses 0.5).")
        sites = (self.sites,) if isinstance(self.sites, str) else tuple(self.sites)
        unknown = [s for s in sites if s not in SITES]
        if unknown or not sites:
            raise ValueError(f"smoothing sites {list(sites)!r} are not known; choose from {list(SITES)}.")
        self.sites = sites

    @classmethod
    def resolve_spec(cls, spec: Any) -> SmoothingConfig | None:
        """``None``/``False``: off; ``True``: defaults; a float: alpha; a dict or a SmoothingConfig."""
        if isinstance(spec, (int, float)) and not isinstance(spec, bool):
            return cls(alpha=float(spec))
        return optional_spec(cls, spec, "smoothing", "give true, an alpha (e.g. 0.5) or a dict such as "
                             "{'alpha': 0.5, 'sites': ['mlp_in']}.")  # fmt: skip


@dataclass
class SmoothingSite:
    """One input to smooth: ``producer`` emits it, every ``consumers`` linear reads it."""

    kind: str
    producer: str
    consumers: tuple[str, ...]
    rows: slice | None = None  # for mlp_down: the producer rows that carry ``up`` (fused gate|up)
    factors: torch.Tensor | None = field(default=None, repr=False)


def _norm_is_foldable(norm: nn.Module, name: str) -> None:
    cls = type(norm).__name__
    if getattr(norm, "zero_centered_gamma", False) or "Gemma" in cls:
        raise ValueError(
            f"{name} ({cls}) stores its gamma zero-centred (scale = 1 + weight), which cannot take a folded "
            "smoothing factor by division; turn smoothing off for this model."
        )
    if not isinstance(getattr(norm, "weight", None), torch.Tensor):
        raise ValueError(
            f"{name} ({cls}) has no gamma to fold smoothing factors into (Transformer Engine fuses the norm into "
            "the next linear); use megatron-core's local or modelopt layer spec, or turn smoothing off."
        )


def find_smoothing_sites(model: nn.Module, sites: tuple[str, ...]) -> list[SmoothingSite]:
    """Every decoder block's ``sites`` (in model order). Raises when the model has none of them."""
    modules = dict(model.named_modules())
    out: list[SmoothingSite] = []
    for block in modules:
        prefix = f"{block}." if block else ""
        for layout in _LAYOUTS:
            paths = [layout[s][0] for s in sites] + [c for s in sites for c in layout[s][1]]
            if not all(prefix + p in modules for p in paths):
                continue
            for kind in sites:
                producer, consumers = layout[kind]
                rows = None
                if kind == "mlp_down":
                    fused = producer.endswith("linear_fc1")  # megatron: gate|up in one linear
                    rows = _up_rows(modules[prefix + producer], prefix + producer, fused)
                else:
                    _norm_is_foldable(modules[prefix + producer], prefix + producer)
                out.append(SmoothingSite(kind, prefix + producer, tuple(prefix + c for c in consumers), rows))
    if not out:
        raise ValueError(
            f"Smoothing sites {list(sites)} match no module of {type(model).__name__}: smoothing knows Hugging Face "
            "Llama-style blocks (input_layernorm, self_attn.q/k/v_proj, post_attention_layernorm, mlp.gate/up/"
            "down_proj) and megatron-core blocks (input_layernorm, self_attention.linear_qkv, pre_mlp_layernorm, "
            "mlp.linear_fc1/fc2). Turn smoothing off for other architectures."
        )
    return out


def _up_rows(producer: nn.Module, name: str, fused: bool) -> slice:
    """Rows of the producer that feed ``down``'s input linearly: all of ``up_proj``, or the up half of
    megatron's fused ``linear_fc1``, which is linear in its input only for gated units (SwiGLU)."""
    n_out = producer.weight.shape[0]
    if not fused:
        return slice(0, n_out)
    if getattr(getattr(producer, "config", None), "gated_linear_unit", False):
        return slice(n_out // 2, n_out)  # megatron's glu: gate, up = fc1(x).chunk(2)
    raise ValueError(
        f"mlp_down smoothing needs {name} to feed the down projection linearly (a gated MLP such as SwiGLU); "
        "this MLP applies its activation to all of it. Drop 'mlp_down' from the smoothing sites."
    )


@torch.no_grad()
def _input_absmax(
    model: nn.Module,
    sites: list[SmoothingSite],
    batches: list[Any],
    forward_fn: Callable[[nn.Module, Any], Any],
) -> list[torch.Tensor]:
    """Per-channel max |x| of each site's input over ``batches``, every quantizer disabled."""
    modules = dict(model.named_modules())
    stats: list[torch.Tensor | None] = [None] * len(sites)
    quantizers = [m for m in model.modules() if is_quantizer(m) and m.is_enabled]
    hooks = []

    def make_hook(i: int) -> Callable[..., None]:
        def hook(_module: nn.Module, args: tuple[Any, ...]) -> None:
            x = args[0].detach().float()
            amax = x.abs().reshape(-1, x.shape[-1]).amax(dim=0)
            stats[i] = amax if stats[i] is None else torch.maximum(stats[i], amax)

        return hook

    try:
        for q in quantizers:
            q.disable()
        for i, site in enumerate(sites):
            hooks.append(modules[site.consumers[0]].register_forward_pre_hook(make_hook(i)))
        forward_batches(model, batches, forward_fn)
    finally:
        for h in hooks:
            h.remove()
        for q in quantizers:
            q.enable()
    missing = [s.consumers[0] for s, a in zip(sites, stats) if a is None]
    if missing:
        raise RuntimeError(f"Smoothing saw no input for {missing[:3]}: the calibration forward does not reach them.")
    return [a for a in stats if a is not None]


def _all_reduce_max(tensors: list[torch.Tensor]) -> None:
    """Every data-parallel rank folds the same factors (ranks calibrate on different samples); under pipeline
    parallelism among the ranks of the same stage only (another stage's sites are other layers)."""
    import torch.distributed as dist

    from nemo_fp4qat.qat.parallel.groups import same_layers_group

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        flat = torch.cat([t.flatten() for t in tensors])
        dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=same_layers_group())
        offset = 0
        for t in tensors:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


@torch.no_grad()
def smooth_model(
    model: nn.Module,
    batches: list[Any],
    config: SmoothingConfig,
    forward_fn: Callable[[nn.Module, Any], Any],
) -> list[SmoothingSite]:
    """Measure the sites' input ranges on ``batches`` and fold SmoothQuant factors into the weights.

    Returns the sites with their ``factors`` (``s``: the input is divided by it, the consumers'
    weight columns multiplied). The model's full-precision output is unchanged up to rounding.
    """
    import torch.distributed as dist

    sites = find_smoothing_sites(model, config.sites)
    if "mlp_down" in config.sites and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        # a row-parallel down projection shards its input across tensor-parallel ranks, so a world-wide
        # max would mix different channels
        raise ValueError("mlp_down smoothing runs on a single process only; drop it from the sites when distributed.")
    act = _input_absmax(model, sites, batches, forward_fn)
    _all_reduce_max(act)
    modules = dict(model.named_modules())
    for site, a in zip(sites, act):
        consumers = [modules[c] for c in site.consumers]
        w = torch.stack([c.weight.detach().abs().float().amax(dim=0) for c in consumers]).amax(dim=0)
        s = (a.double().clamp(min=1e-5) ** config.alpha / w.double().clamp(min=1e-5) ** (1 - config.alpha)).clamp(
            min=1e-5
        )
        producer = modules[site.producer]
        if site.rows is None:  # a norm: gamma (and beta) divided by s
            producer.weight.div_(s.to(producer.weight.dtype))
            if getattr(producer, "bias", None) is not None:
                producer.bias.div_(s.to(producer.bias.dtype))
        else:  # up_proj rows divided by s
            producer.weight[site.rows].div_(s[:, None].to(producer.weight.dtype))
            if getattr(producer, "bias", None) is not None:
                producer.bias[site.rows].div_(s.to(producer.bias.dtype))
        for c in consumers:
            c.weight.mul_(s.to(c.weight.dtype))
        site.factors = s.float()
    return sites
