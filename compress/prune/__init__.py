"""Structured pruning passes (Minitron-style), one module per structure: ``heads``, ``mlp``,
``hidden``, ``depth``; ``config`` holds their configs and ``slicing`` what they share.

The passes (Minitron-style): attention heads, MLP channels, hidden channels and
whole decoder layers, producing a smaller *dense* model. Which linears prune together comes from
the model family's entry in ``compress.arch`` (Llama: q rows, k/v rows per KV head and o columns
per head; gate/up rows and down columns per MLP channel).

Importance follows Minitron (Muralidharan et al., 2024, "Compact Language Models via Pruning and
Knowledge Distillation"): activations on a calibration set, captured with hooks --
per-head L2 norm of the attention output before the output projection, mean |activation| at
the input of the down projection per MLP channel, mean |activation| after every RMSNorm per
hidden channel, and for depth the block influence of ShortGPT (Men et al., 2024): mean
``1 - cos(input, output)`` of each decoder layer. ``importance: magnitude`` is a weight-norm
baseline for comparison.

Every layer keeps the same number of units (chosen per layer by its own scores), so the result
is expressible by the ordinary config (``num_attention_heads``, ``num_key_value_heads``,
``intermediate_size``, ``hidden_size``, ``num_hidden_layers``) and loads with plain
``AutoModelForCausalLM.from_pretrained``. Targets: ``sparsity`` (fraction removed), an explicit
size, or ``target_params`` (a total parameter budget such as ``90M``). Not done: per-layer
widths (not loadable by transformers), pruning of quantized layers, families not in
``compress.arch``.

Per family (``compress.arch``): fused linears (Phi-3's ``[q; k; v]`` and ``[gate; up]``) lose
the same heads/channels in every part; q/k norms over one head (Qwen3, Gemma3) are untouched by
head pruning, OLMo2's over all heads lose the pruned heads' entries (its q/k RMS then runs over
the kept heads only, so a head-pruned OLMo2 is not exactly the head-masked model); post-norms
(Gemma, OLMo2) are sliced with the hidden size; Gemma's embedding factor ``sqrt(hidden_size)``
is reset to what a reload computes, with every post-norm scaled by the same ratio so that the
residual stream's scale, to which the pre-norms are invariant, is all that changes.
"""

# The pass modules, imported for their @register_pass side effect: a config taken from
# ``compress.prune.config`` must name its pass in ``run_passes`` without ``compress.recipe``.
from compress.prune import depth, heads, hidden, mlp  # noqa: E402, F401
