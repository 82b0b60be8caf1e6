"""LoRA through ``peft`` on kvcache's ``Transformer``: adapters on modules chosen by name, merged
into the weights on request. ``peft`` is an optional dependency (``pip install kvcache[train]``)."""

from __future__ import annotations

import torch

# The projections of every attention block and MLP (module names as in Hugging Face's Llama).
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def _peft():
    try:
        import peft
    except ImportError:
        raise ImportError("LoRA needs the peft package: pip install 'kvcache[train]' (or pip install peft)") from None
    return peft


def add_lora(model: torch.nn.Module, rank: int, *, alpha: float | None = None,
             targets: tuple[str, ...] = DEFAULT_TARGETS, dropout: float = 0.0) -> torch.nn.Module:
    """Wrap ``model`` (a ``kvcache.Transformer``) in a peft model with rank-``rank`` LoRA
    adapters on every linear layer whose name ends in one of ``targets``. The base weights are
    frozen; only the adapters train. ``alpha`` defaults to ``rank`` (a scale of 1)."""
    if rank <= 0:
        raise ValueError(f"LoRA rank must be positive, got {rank}")
    names = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    unknown = sorted(set(targets) - names)
    if unknown:
        raise ValueError(f"no linear layer of the model is named {unknown}; its linear layers: {sorted(names)}")
    peft = _peft()
    config = peft.LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else rank, lora_dropout=dropout,
                             target_modules=list(targets), bias="none")
    return peft.get_peft_model(model, config)


def is_lora(model: torch.nn.Module) -> bool:
    return hasattr(model, "merge_and_unload")


def merge_lora(model: torch.nn.Module) -> torch.nn.Module:
    """The plain ``kvcache.Transformer`` with every adapter merged into its weights."""
    return model.merge_and_unload() if is_lora(model) else model


def save_adapter(model: torch.nn.Module, out) -> None:
    """Write the adapters alone in peft's format (``adapter_config.json``,
    ``adapter_model.safetensors``), named as in the Hugging Face model (``model.layers...``), so
    that ``peft.PeftModel.from_pretrained(transformers_model, out)`` loads them."""
    from pathlib import Path

    from safetensors.torch import save_file

    peft = _peft()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = peft.get_peft_model_state_dict(model)
    # peft names the adapters after the wrapped module ("base_model.model.layers.0..."); the
    # Hugging Face model keeps the same modules under "model." ("base_model.model.model.layers...").
    prefix = "base_model.model."
    renamed = {}
    for name, tensor in state.items():
        rest = name.removeprefix(prefix)
        renamed[prefix + (rest if rest.startswith("lm_head") else f"model.{rest}")] = tensor.detach().cpu().contiguous()
    save_file(renamed, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = model.peft_config["default"]
    config.save_pretrained(str(out))
