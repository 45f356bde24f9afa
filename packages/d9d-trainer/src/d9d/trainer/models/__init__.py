"""d9d.trainer.models: the model d9d ships, a Llama/Qwen3-style decoder in plain PyTorch that computes
Llama (3.x RoPE scaling included), Qwen2/2.5, Qwen3, Qwen3-MoE, Mistral and Mixtral exactly, with its
Hugging Face mappers, KV cache and tensor/expert/pipeline plans (docs/models.md).

    from d9d.trainer.models import ReferenceForCausalLM, ReferenceModelConfig, save_hf_pretrained

    config = ReferenceModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                  num_layers=2, num_attention_heads=4, num_key_value_heads=2)
    with torch.device("meta"):
        model = ReferenceForCausalLM(config)
    model.to_empty(device="cpu")
    model.init_weights()
    logits = model(input_ids)            # [batch, seq, vocab]
    save_hf_pretrained(model, "hf_out")  # a Hugging Face folder transformers loads

The built-in providers train it from a config file alone: `d9d.trainer:ReferenceModelProvider`
(the `model:` section is a `ReferenceModelConfig`) and `d9d.trainer:HFModelProvider` (a Hugging Face
folder, trained by this model or by transformers' own).
"""

from typing import TYPE_CHECKING

from d9d.mesh.lazy import lazy_face

if TYPE_CHECKING:  # the public names, listed once: `lazy_face` reads this block
    from d9d.trainer.models.attention_inputs import KVCache
    from d9d.trainer.models.config import (
        ClassificationHead,
        EmbeddingHead,
        HeadConfig,
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
    from d9d.trainer.models.heads import (
        HeadExportError,
        ReferenceWithHead,
        build_reference_model,
        check_head_export,
        last_token_index,
        pool,
    )
    from d9d.trainer.models.hf_config import (
        HFConversionError,
        from_hf_config,
        hf_model_type,
        read_hf_config,
        to_hf_config,
    )
    from d9d.trainer.models.hf_weights import (
        ExpertLayout,
        head_fresh_keys,
        hf_checkpoint_keys,
        hf_expert_layout,
        hf_export_mapper,
        hf_import_mapper,
        load_hf_pretrained,
        save_hf_pretrained,
    )
    from d9d.trainer.models.model import (
        MLP,
        Attention,
        DecoderLayer,
        ReferenceForCausalLM,
        ReferenceModel,
        RMSNorm,
        build_moe,
    )
    from d9d.trainer.models.parallelize import (
        apply_expert_parallel,
        apply_tensor_parallel,
        check_mesh,
        decoder_parts,
        shard_units,
        tensor_parallel_plan,
        trim_to_stage,
    )
    from d9d.trainer.models.rope import (
        RotaryEmbedding,
        apply_rotary,
        rope_attention_factor,
        rope_inverse_frequencies,
    )

__all__, __getattr__, __dir__ = lazy_face(__name__, globals())
