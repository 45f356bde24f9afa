"""The d9d reference model: a Llama/Qwen3-style decoder in plain PyTorch (see README.md).

config = ReferenceModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                              num_layers=2, num_attention_heads=4, num_key_value_heads=2)
with torch.device("meta"):
    model = ReferenceForCausalLM(config)
model.to_empty(device="cpu")
model.init_weights()
logits = model(input_ids)            # [batch, seq, vocab]
save_hf_pretrained(model, "hf_out")  # a Hugging Face folder (qwen3, llama, mistral, qwen2, qwen3_moe, mixtral)
"""

from .config import (
    LinearRopeScaling,
    Llama3RopeScaling,
    MoEBalancingConfig,
    MoEConfig,
    ReferenceModelConfig,
    ReferenceModelConfigError,
    RopeScaling,
    SlidingWindowError,
    YarnRopeScaling,
    check_sequence_length,
)
from .mappers import (
    ExpertLayout,
    HFConversionError,
    from_hf_config,
    hf_checkpoint_keys,
    hf_expert_layout,
    hf_export_mapper,
    hf_import_mapper,
    hf_model_type,
    load_hf_pretrained,
    read_hf_config,
    save_hf_pretrained,
    to_hf_config,
)
from .model import (
    MLP,
    Attention,
    DecoderLayer,
    KVCache,
    ReferenceForCausalLM,
    ReferenceModel,
    RMSNorm,
    build_moe,
)
from .parallelize import (
    apply_expert_parallel,
    apply_tensor_parallel,
    check_mesh,
    decoder_parts,
    shard_units,
    tensor_parallel_plan,
    trim_to_stage,
)
from .rope import RotaryEmbedding, apply_rotary, rope_attention_factor, rope_inverse_frequencies

__all__ = [
    "MLP",
    "Attention",
    "DecoderLayer",
    "ExpertLayout",
    "HFConversionError",
    "KVCache",
    "LinearRopeScaling",
    "Llama3RopeScaling",
    "MoEBalancingConfig",
    "MoEConfig",
    "RMSNorm",
    "ReferenceForCausalLM",
    "ReferenceModel",
    "ReferenceModelConfig",
    "ReferenceModelConfigError",
    "RopeScaling",
    "RotaryEmbedding",
    "SlidingWindowError",
    "YarnRopeScaling",
    "apply_expert_parallel",
    "apply_rotary",
    "apply_tensor_parallel",
    "build_moe",
    "check_mesh",
    "check_sequence_length",
    "decoder_parts",
    "from_hf_config",
    "hf_checkpoint_keys",
    "hf_expert_layout",
    "hf_export_mapper",
    "hf_import_mapper",
    "hf_model_type",
    "load_hf_pretrained",
    "read_hf_config",
    "rope_attention_factor",
    "rope_inverse_frequencies",
    "save_hf_pretrained",
    "shard_units",
    "tensor_parallel_plan",
    "to_hf_config",
    "trim_to_stage",
]
