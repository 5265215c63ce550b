"""The embedded tiny MoE: a Qwen3-MoE-architecture model with its own character tokenizer,
pretrained here (supervised, on generated data: `trillora.tiny.pretrain`), shipped inside the
package and loaded by name (`load_model("tiny-moe")`).

    python -m trillora.tiny build [OUT]       # pretrain and write the shipped checkpoint
    python -m trillora.tiny build-chat [OUT]  # the chat variant with tool calls (`tiny-moe-chat`)
    python -m trillora.tiny random OUT      # random weights, same architecture (tests)

This module holds what defines the model: its architecture, its tokenizer, and random
checkpoints of the same shapes for tests.
"""

from __future__ import annotations

import string
from pathlib import Path

import torch

from ..checkpoint import save_model
from ..models import CausalLM, build_model, from_hf_config

SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
CHARS = string.digits + string.ascii_letters + string.punctuation + " \n"

TINY_QWEN3_MOE = dict(
    architectures=["Qwen3MoeForCausalLM"],
    model_type="qwen3_moe",
    hidden_size=128,
    intermediate_size=256,
    moe_intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    max_position_embeddings=512,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    hidden_act="silu",
)


def tiny_config(width: int = 128) -> dict:
    """The tiny MoE's recipe at another width (a model family for compute-matched comparisons):
    heads of 32, half as many kv heads, MLPs 2× and experts ½× the width; 128 is the shipped model."""
    if width < 32 or width % 64:
        raise ValueError(f"width={width}: a multiple of 64 (heads of 32, half as many kv heads)")
    heads = width // 32
    return dict(
        TINY_QWEN3_MOE,
        hidden_size=width,
        intermediate_size=2 * width,
        moe_intermediate_size=width // 2,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,
    )


MOE_KEYS = (
    "num_experts",
    "num_experts_per_tok",
    "norm_topk_prob",
    "decoder_sparse_step",
    "mlp_only_layers",
    "moe_intermediate_size",
)
TINY_QWEN3 = {
    **{k: v for k, v in TINY_QWEN3_MOE.items() if k not in MOE_KEYS},
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
}
"""The same shapes without experts: vLLM on CPU applies LoRA to dense models only."""


def build_tokenizer():
    """One token per character: arithmetic and short words need nothing more, and it is exact."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + tuple(CHARS))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>"
    )


CHAT_SPECIALS = ("<|im_start|>", "<|im_end|>")
TOOL_MARKERS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- if tools %}<|im_start|>system\ntools:"
    "{%- for t in tools %} {{ t.function.name }}({{ t.function.parameters.properties.keys() | join(', ') }})"
    "{%- endfor %}<|im_end|>{% endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'tool' -%}"
    "<|im_start|>tool\n<tool_response>{{ m.content }}</tool_response><|im_end|>"
    "{%- elif m.role == 'assistant' -%}"
    "<|im_start|>assistant\n{{ m.content or '' }}"
    "{%- for c in m.tool_calls or [] -%}"
    "{%- set args = c.function.arguments -%}"
    '<tool_call>{"name": "{{ c.function.name }}", "arguments": '
    "{{ args if args is string else args | tojson }}}</tool_call>"
    "{%- endfor -%}<|im_end|>"
    "{%- else -%}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif -%}"
)
"""The chat variant's template: Qwen's turn markers and Hermes tool calls, compact because every
character is a token (tools listed by signature rather than as whole JSON schemas)."""


def build_chat_tokenizer():
    """The character tokenizer plus turn markers (special) and tool-call markers (as in Qwen3: not special)."""
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": list(CHAT_SPECIALS)})
    tokenizer.add_tokens(list(TOOL_MARKERS))
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def new_model(tokenizer, base: dict, seed: int, std: float = 0.02) -> CausalLM:
    """A freshly initialised tiny model of `base`'s shape over `tokenizer`'s vocabulary and special ids."""
    ids = {f"{k}_token_id": getattr(tokenizer, f"{k}_token_id") for k in ("bos", "eos", "pad")}
    model = build_model(from_hf_config(dict(base, vocab_size=len(tokenizer), **ids), where="tiny config"), device="cpu")
    model.init_weights(std=std, generator=torch.Generator().manual_seed(seed))
    return model


def save(model: CausalLM, tokenizer, out: str | Path) -> Path:
    """A Hugging Face checkpoint folder: the weights, then the tokenizer beside them."""
    out = save_model(model, out)
    tokenizer.save_pretrained(out)
    return out


def write_random_checkpoint(
    out: str | Path, seed: int = 0, std: float = 0.05, dense: bool = False, chat: bool = False
) -> Path:
    tokenizer = build_chat_tokenizer() if chat else build_tokenizer()
    return save(new_model(tokenizer, TINY_QWEN3 if dense else TINY_QWEN3_MOE, seed, std), tokenizer, out)
