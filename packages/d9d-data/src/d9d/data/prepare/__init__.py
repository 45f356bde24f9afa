"""Prepare a corpus once for training: documents from text, JSONL and Parquet files, tokenized in
parallel into memory-mappable token shards plus one index (`prepare_dataset`, `d9d data prepare`).

Every source file becomes one shard, `shard-<i>.bin` (i: the file's position in the sorted source
list), holding the token ids of its documents, each followed by the end-of-document token; a Hugging
Face tokenizer's files are copied into `tokenizer/`, so the folder needs nothing outside it. A `.txt`
file is one document; a `.jsonl` line (also `.jsonl.gz`, and `.jsonl.zst` with the `zstandard`
package) and a Parquet row are one document each, their text under `text_key`. A shard depends on its
source alone, so the output is the same bytes whatever the number of workers.

Crash safety: a shard is written under a temporary name and renamed when complete, and recorded in
`.prepare/` when its worker returns; `index.json`, which `PreparedDataset` needs, is written (also by
rename) only when every shard is done. A prepare that is killed and started again with the same
arguments keeps the shards it finished (same source size, tokenizer and text key) and does the rest.

One module per part: `sources` (which files) and `documents` (what is in one), `pool` (tokenizing
shards in worker processes), `writer` (the resumable folder), `index` (its `index.json`), `progress`
(the progress and summary lines), and `dataset` (`prepare_dataset`, the phases in order).

Public names are exported from `d9d.data`.
"""
