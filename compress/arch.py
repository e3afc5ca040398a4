"""Where the architecture of a transformers causal LM is: for now, its decoder layers.

Every pass and the runtime find the decoder stack through ``decoder_layers``, so supporting a new
layout changes one function. Only stacks at ``model.model.layers`` (Llama, Qwen2, Mistral, ...
in transformers) are supported. Not here yet: per-``model_type`` norm -> linear mappings,
prune groups and runtime support, which still live in the passes that use them.
"""

from __future__ import annotations

from torch import nn

from compress.errors import ConfigError


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """``model.model.layers`` (non-empty), or a ConfigError naming the model class."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise ConfigError(
            f"{type(model).__name__} has no model.model.layers decoder stack; compress supports "
            "Llama-style causal LMs (LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM, ...)"
        )
    return layers
