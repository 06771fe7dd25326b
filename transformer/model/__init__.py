"""The model and its decoding: pure Flax modules and functions of (params, inputs).

primitives.py   ModelConfig, initializers, masks, positions (the shape-letter legend)
attention.py    multi-head self- and cross-attention, with the decoding cache
layers.py       embedding, feed-forward, residual sublayers, encoder and decoder layers
transformer.py  the stacks (looped or scanned), Transformer, model_inputs
incremental.py  the model's side of decoding: prefill, feed, the cache's row operations
decoding/       decode(model, params, prompts, search): beam search, greedy, sampling
                and speculative decoding over one prefill and cache
draft.py        a shallow draft for speculative decoding on the target's encoder
"""

from transformer.model.primitives import ModelConfig
from transformer.model.transformer import Transformer, model_inputs, stack_layer_params

__all__ = ["ModelConfig", "Transformer", "model_inputs", "stack_layer_params"]
