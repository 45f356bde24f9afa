"""d9d.data: a fixed global batch per step over any map-style dataset, sharded over data-parallel ranks.

    from d9d.data import AutoDataConfig, AutoDataProvider, TextDataset

    dataset = TextDataset("examples/data", seq_len=128)             # byte-level tokens, packed
    provider = AutoDataProvider(AutoDataConfig(global_batch_size=32, microbatch_size=4), dataset)
    microbatches = next(provider)                                    # one step: 8 microbatches of 4

The global sample order never depends on the data-parallel degree (nor is it ever materialized: any
rank computes the sample at any position in O(1) memory), and `state_dict()` /
`load_state_dict()` resume with exactly the next global batch, also on another number of ranks.
"""

from typing import TYPE_CHECKING

from d9d.mesh.lazy import lazy_face

if TYPE_CHECKING:  # the public names, listed once: `lazy_face` reads this block
    from d9d.data.auto import AutoDataProvider, MapDataset
    from d9d.data.batching import (
        advance_position,
        batch_size_choices,
        check_batch_sizes,
        check_dataset_size,
        is_step_start,
        microbatches_per_rank,
        rank_slice,
        step_sample_indices,
        steps_per_epoch,
    )
    from d9d.data.config import AutoDataConfig
    from d9d.data.datasets.mixture import MixtureDataset
    from d9d.data.datasets.packed import IGNORE_INDEX, CausalLMSample, PackedTokens
    from d9d.data.datasets.preference import PreferenceDataset, PreferenceStats, collate_preference
    from d9d.data.datasets.prepared import PreparedDataset
    from d9d.data.datasets.prompts import PromptDataset, collate_prompts
    from d9d.data.datasets.sft import SFTDataset, SFTStats
    from d9d.data.datasets.text import TextDataset
    from d9d.data.datasets.token_file import TokenFileDataset, TokenFileInfo, write_token_file
    from d9d.data.datasets.tokenizer import ByteTokenizer, ChatTokenizer, Tokenizer, load_tokenizer
    from d9d.data.datasets.tokenizer_files import (
        TOKENIZER_FILES,
        DeclaresTokenizerFiles,
        copy_tokenizer_files,
        tokenizer_digest,
        tokenizer_files,
        tokenizer_files_at,
    )
    from d9d.data.device import pin_memory_enabled, to_device
    from d9d.data.errors import (
        BatchSizeError,
        DataConfigError,
        DataError,
        DatasetError,
        DataStateError,
        TokenizerError,
    )
    from d9d.data.order import EpochOrder, epoch_order
    from d9d.data.packing import (
        PADDING_DOCUMENT_ID,
        block_causal_mask,
        document_positions,
        eos_document_ids,
        pack_lengths,
    )
    from d9d.data.placement import DataPlacement, PipelineStages
    from d9d.data.prepare.dataset import prepare_dataset
    from d9d.data.prepare.index import PreparedIndex, PreparedShard, read_index
    from d9d.data.protocol import (
        DataProvider,
        DeclaresDocumentMasking,
        DeclaresSeqLen,
        DeclaresSources,
        DeclaresStepsLeft,
        DeclaresVocabSize,
        OrdersItself,
        ReportsSources,
        SizedDataProvider,
    )

__all__, __getattr__, __dir__ = lazy_face(__name__, globals())
