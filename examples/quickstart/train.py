"""Quickstart: train a small Llama/Qwen3-style model on the corpus in examples/data.

    python train.py config.yaml                              # one device, no process group
    torchrun --nproc-per-node 2 train.py config.yaml --set mesh.data_parallel_shard=2
    uv run d9d train config.yaml                             # the same job through the CLI

The job is config.yaml: it names the built-in providers, the model d9d ships
(`d9d.trainer:ReferenceModelProvider`, whose `model:` section is a `d9d.trainer.models.ReferenceModelConfig`)
and a text corpus (`d9d.trainer:TextDatasetProvider`). Your own providers go in a file like this one
and are named `train.py:MyProvider` in `providers:` (`d9d init` writes a project that does; the
d9d-trainer README shows the protocols).
"""

from d9d.trainer import ReferenceModelProvider, TextDatasetProvider, main

#: The names earlier configs gave these providers (`train.py:QuickstartModelProvider`, ...).
QuickstartModelProvider = ReferenceModelProvider
CorpusProvider = TextDatasetProvider

if __name__ == "__main__":
    main()
