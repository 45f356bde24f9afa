import importlib.util
import json
import pickle
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from d9d.data import (
    IGNORE_INDEX,
    PADDING_DOCUMENT_ID,
    AutoDataConfig,
    AutoDataProvider,
    ByteTokenizer,
    ChatTokenizer,
    DatasetError,
    SFTDataset,
    TextDataset,
    TokenFileDataset,
    TokenizerError,
    block_causal_mask,
    document_positions,
    eos_document_ids,
    load_tokenizer,
    pack_lengths,
    write_token_file,
)

REPO = Path(__file__).resolve().parents[3]
HAS_CHAT = all(importlib.util.find_spec(m) is not None for m in ("tokenizers", "jinja2"))
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
needs_chat = pytest.mark.skipif(not HAS_CHAT, reason="needs the optional tokenizers and jinja2 packages")

# Qwen2.5-style ChatML: whitespace control with "-", a default system prompt, tools through tojson.
QWEN_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if message.role not in ['system', 'user', 'assistant'] %}
        {{- raise_exception('Unknown role: ' + message.role) }}
    {%- endif %}
    {%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or message.role == 'assistant' %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# No "-" at all: the output is only right with trim_blocks and lstrip_blocks. Also a special-token
# variable, tojson of non-ASCII text, a namespace, a loop control and a {% generation %} block.
PLAIN_TEMPLATE = """{% set ns = namespace(turns=0) %}
{% for message in messages %}
    {% if message['role'] == 'ignore' %}
        {% continue %}
    {% endif %}
    {% set ns.turns = ns.turns + 1 %}
    {% if message['role'] == 'system' %}
<|im_start|>system
{{ message | tojson }}<|im_end|>
    {% elif message['role'] == 'user' %}
<|im_start|>user {{ ns.turns }}
{{ message['content'] }}<|im_end|>
    {% else %}
<|im_start|>assistant
{% generation %}{{ message['content'] | trim }}{{ eos_token }}{% endgeneration %}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}
"""

CONVERSATIONS = [
    [{"role": "user", "content": "It was the best of times."}, {"role": "assistant", "content": "It was."}],
    [
        {"role": "system", "content": "You answer in one word — «oui»."},
        {"role": "user", "content": "Call me Ishmael?"},
        {"role": "assistant", "content": "  Yes  "},
        {"role": "user", "content": "And then?\n\nTwo lines."},
        {"role": "assistant", "content": "Whale. 日本"},
    ],
    [{"role": "user", "content": "a literal <|im_end|> inside"}, {"role": "assistant", "content": ""}],
    [{"role": "user", "content": "only a question"}],
    [
        {"role": "user", "content": "x"},
        {"role": "ignore", "content": "skipped by the plain template"},
        {"role": "assistant", "content": "y"},
    ],
]


def _write_tokenizer_folder(folder: Path, *, template_in_config: str, template_file: str | None) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train([str(REPO / "examples" / "data" / "corpus.txt")], trainer)
    folder.mkdir(parents=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": {"__type": "AddedToken", "content": "<|endoftext|>", "special": True},
        "chat_template": template_in_config,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    if template_file is not None:
        (folder / "chat_template.jinja").write_text(template_file, encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def qwen_folder(tmp_path_factory):
    if not HAS_CHAT:
        pytest.skip("needs the optional tokenizers and jinja2 packages")
    return _write_tokenizer_folder(
        tmp_path_factory.mktemp("tok") / "qwen", template_in_config=QWEN_TEMPLATE, template_file=None
    )


@pytest.fixture(scope="module")
def plain_folder(tmp_path_factory):
    if not HAS_CHAT:
        pytest.skip("needs the optional tokenizers and jinja2 packages")
    # chat_template.jinja takes precedence over the config's template, in transformers and here.
    return _write_tokenizer_folder(
        tmp_path_factory.mktemp("tok") / "plain",
        template_in_config=QWEN_TEMPLATE,
        template_file=PLAIN_TEMPLATE,
    )


def _jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return path


@pytest.mark.skipif(
    not HAS_TRANSFORMERS, reason="transformers is not installed: nothing to compare the ids with"
)
@pytest.mark.parametrize("which", ["qwen", "plain"])
def test_chat_template_ids_equal_transformers(which, qwen_folder, plain_folder):
    from transformers import AutoTokenizer

    folder = qwen_folder if which == "qwen" else plain_folder
    ours = load_tokenizer(folder)
    theirs = AutoTokenizer.from_pretrained(str(folder))
    assert isinstance(ours, ChatTokenizer)
    conversations = CONVERSATIONS if which == "plain" else CONVERSATIONS[:4]
    for messages in conversations:
        for prompt in (False, True):
            expected = theirs.apply_chat_template(messages, add_generation_prompt=prompt, return_dict=False)
            assert ours.apply_chat_template(messages, add_generation_prompt=prompt) == list(expected)
            text = theirs.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=False)
            assert ours.render_chat(messages, add_generation_prompt=prompt) == text
        assert ours.encode_chat(messages)[0].tolist() == list(
            theirs.apply_chat_template(messages, return_dict=False)
        )
    assert ours.eos_id == theirs.eos_token_id and ours.pad_id == theirs.pad_token_id
    assert ours.bos_id is None and theirs.bos_token_id is None


def test_hf_folder_special_tokens_and_template_errors(qwen_folder, tmp_path):
    tokenizer = load_tokenizer(qwen_folder)
    assert tokenizer.special_tokens == {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    assert tokenizer.decode([tokenizer.eos_id]) == "" and tokenizer.eos_id == 2 and tokenizer.pad_id == 0
    clone = pickle.loads(pickle.dumps(tokenizer))
    assert clone.apply_chat_template(CONVERSATIONS[0]) == tokenizer.apply_chat_template(CONVERSATIONS[0])
    with pytest.raises(TokenizerError, match="Unknown role: tool"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "x"}])
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer.json").write_bytes((qwen_folder / "tokenizer.json").read_bytes())
    (broken / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<missing>"}))
    with pytest.raises(TokenizerError, match="names eos_token='<missing>', which"):
        load_tokenizer(broken)
    (broken / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% if %}"}))
    with pytest.raises(TokenizerError, match="does not compile"):
        load_tokenizer(broken).apply_chat_template(CONVERSATIONS[0])
    (broken / "tokenizer_config.json").write_text("{}")
    with pytest.raises(TokenizerError, match="has no chat template"):
        load_tokenizer(broken).apply_chat_template(CONVERSATIONS[0])


def test_missing_optional_packages_name_what_to_install(qwen_folder, monkeypatch):
    tokenizer = load_tokenizer(qwen_folder)
    monkeypatch.setitem(sys.modules, "jinja2", None)
    tokenizer._chat_template += "{# another template: not in the compile cache #}"
    with pytest.raises(
        TokenizerError,
        match=r"needs jinja2, which is not installed; install the `chat` extra: .*d9d-data\[chat\]",
    ):
        tokenizer.apply_chat_template(CONVERSATIONS[0])
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(TokenizerError, match=r"needs the optional `tokenizers` package.*d9d-data\[chat\]"):
        load_tokenizer(qwen_folder)


def test_labels_are_the_assistant_turns(qwen_folder, tmp_path):
    tokenizer = load_tokenizer(qwen_folder)
    path = _jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in CONVERSATIONS[:3]])
    dataset = SFTDataset(path, seq_len=256, tokenizer=qwen_folder)
    assert len(dataset) == 3 and dataset.stats.samples == 3
    sample = dataset[1]
    ids = tokenizer.apply_chat_template(CONVERSATIONS[1])
    n = len(ids) - 1
    assert sample["input_ids"][:n].tolist() == ids[:-1]
    assert (sample["input_ids"][n:] == tokenizer.pad_id).all() and (
        sample["labels"][n:] == IGNORE_INDEX
    ).all()
    labels = sample["labels"][:n]
    kept = labels != IGNORE_INDEX
    assert labels[kept].tolist() == torch.tensor(ids[1:])[kept].tolist()  # next tokens, where trained
    # Trained: each assistant turn's content, <|im_end|> and newline; not the system/user turns or headers.
    assert tokenizer._tokenizer.decode(labels[kept].tolist(), skip_special_tokens=False) == (
        "  Yes  <|im_end|>\nWhale. 日本<|im_end|>\n"
    )
    # An empty assistant turn still trains on its end-of-turn.
    assert tokenizer._tokenizer.decode(
        [t for t in dataset[2]["labels"].tolist() if t != IGNORE_INDEX], skip_special_tokens=False
    ) == ("<|im_end|>\n")
    everything = SFTDataset(path, seq_len=256, tokenizer=qwen_folder, train_on="all")
    assert everything[1]["labels"][:n].tolist() == ids[1:]


def test_a_template_that_rewrites_earlier_turns_is_refused_for_assistant_labels(qwen_folder, tmp_path):
    folder = tmp_path / "rewriting"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes((qwen_folder / "tokenizer.json").read_bytes())
    template = "{% for m in messages %}{% if loop.last %}last: {% endif %}{{ m.content }}\n{% endfor %}"
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    path = _jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATIONS[1]}])
    with pytest.raises(
        DatasetError, match=r"chat.jsonl:1: cannot tell which tokens belong to assistant message 2"
    ):
        SFTDataset(path, seq_len=256, tokenizer=folder)
    assert len(SFTDataset(path, seq_len=256, tokenizer=folder, train_on="all")) == 1


def test_prompt_completion_with_the_byte_tokenizer(tmp_path):
    path = _jsonl(
        tmp_path / "pc.jsonl", [{"prompt": "2+2=", "completion": "4"}, {"prompt": "hi", "completion": "yo"}]
    )
    dataset = SFTDataset(path, seq_len=8)
    sample = dataset[0]
    # bytes "2+2=4" + EOS (256); inputs are all but the last, labels the next token where it is completion.
    assert sample["input_ids"].tolist() == [ord(c) for c in "2+2=4"] + [256, 256, 256]
    assert sample["labels"].tolist() == [IGNORE_INDEX] * 3 + [ord("4"), 256] + [IGNORE_INDEX] * 3
    assert SFTDataset(path, seq_len=8, train_on="all")[0]["labels"][:5].tolist() == [
        ord(c) for c in "+2=4"
    ] + [256]
    assert dataset.stats.label_tokens == 2 + 3 and dataset.stats.tokens == 5 + 4


def test_overflow_truncate_and_drop_counts(tmp_path):
    records = [
        {"prompt": "p", "completion": "short"},  # 7 tokens with EOS
        {"prompt": "p", "completion": "a much longer completion"},  # 26
        {"prompt": "a prompt longer than seq_len", "completion": "x"},  # nothing left to train on
    ]
    path = _jsonl(tmp_path / "pc.jsonl", records)
    truncated = SFTDataset(path, seq_len=10, overflow="truncate")
    assert (
        truncated.stats.truncated,
        truncated.stats.dropped_too_long,
        truncated.stats.dropped_without_labels,
    ) == (
        1,
        0,
        1,
    )
    assert len(truncated) == 2 and truncated[1]["input_ids"].tolist() == [ord(c) for c in "pa much lo"]
    assert truncated[1]["labels"].tolist() == [ord(c) for c in "a much lon"]
    dropped = SFTDataset(path, seq_len=10, overflow="drop")
    assert (dropped.stats.records, dropped.stats.samples, dropped.stats.dropped_too_long) == (3, 1, 2)
    assert "1 of 3 records kept" in str(dropped.stats)
    with pytest.raises(DatasetError, match="no sample left"):
        SFTDataset(path, seq_len=3, overflow="drop")
    with pytest.raises(DatasetError, match="overflow must be"):
        SFTDataset(path, seq_len=10, overflow="wrap")


def test_malformed_lines_name_file_and_line(tmp_path, qwen_folder):
    good = json.dumps({"prompt": "a", "completion": "b"})
    cases = {
        "not valid JSON": "{nope",
        "must be a JSON object": "[1, 2]",
        "needs 'messages'": json.dumps({"prompt": "a"}),
        "message 1 must be an object with string 'role' and 'content'": json.dumps(
            {"messages": [{"role": "user", "content": "a"}, {"role": "assistant"}]}
        ),
        "non-empty list": json.dumps({"messages": []}),
        "message 0 has role 'robot'; the roles accepted are system, user, assistant, tool": json.dumps(
            {"messages": [{"role": "robot", "content": "a"}]}
        ),
    }
    for i, (message, bad) in enumerate(cases.items()):
        path = tmp_path / f"bad{i}.jsonl"
        path.write_text(f"{good}\n\n{bad}\n{good}\n", encoding="utf-8")
        with pytest.raises(DatasetError, match=rf"{path.name}:3: .*{message}"):
            SFTDataset(path, seq_len=16, tokenizer=qwen_folder)
    wizard = _jsonl(tmp_path / "wizard.jsonl", [{"messages": [{"role": "wizard", "content": "a"}]}])
    with pytest.raises(DatasetError, match=r"wizard.jsonl:1: message 0 has role 'wizard'"):
        SFTDataset(wizard, seq_len=16, tokenizer=qwen_folder)  # a template would render it silently
    with pytest.raises(DatasetError, match="Unknown role: wizard"):  # accepted here: the template's own check
        SFTDataset(wizard, seq_len=16, tokenizer=qwen_folder, roles=("user", "wizard"))
    chat = _jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATIONS[0]}])
    with pytest.raises(
        DatasetError, match=r"chat.jsonl:1: chat messages need a tokenizer with a chat template"
    ):
        SFTDataset(chat, seq_len=16)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match=r"holds no \*\.jsonl files"):
        SFTDataset(tmp_path / "empty", seq_len=16)


def test_packing_positions_document_ids_and_efficiency(tmp_path):
    rng = np.random.default_rng(0)
    records = [
        {"prompt": "q" * int(n), "completion": "a" * int(m)} for n, m in rng.integers(1, 20, size=(40, 2))
    ]
    folder = tmp_path / "sft"
    folder.mkdir()
    _jsonl(folder / "b.jsonl", records[20:])
    _jsonl(folder / "a.jsonl", records[:20])
    plain = SFTDataset(folder, seq_len=64)
    packed = SFTDataset(folder, seq_len=64, pack=True)
    assert plain.files == packed.files == [folder / "a.jsonl", folder / "b.jsonl"]
    assert len(plain) == 40 and len(packed) < 40 and packed.num_records == 40
    assert packed.packing_efficiency == pytest.approx(plain.stats.tokens / (len(packed) * 64))
    assert packed.packing_efficiency > 0.9 and plain.packing_efficiency < 0.5
    seen = []
    for row in range(len(packed)):
        sample = packed[row]
        doc, pos = sample["document_ids"], sample["position_ids"]
        assert doc.shape == pos.shape == (64,)
        assert pos.tolist() == document_positions(doc.numpy()).tolist()
        for d in doc.unique().tolist():
            where = doc == d
            if d == PADDING_DOCUMENT_ID:
                assert (sample["labels"][where] == IGNORE_INDEX).all()
                continue
            assert pos[where].tolist() == list(range(int(where.sum())))
            seen.append((sample["input_ids"][where].tolist(), sample["labels"][where].tolist()))
    expected = []
    for record in records:
        ids = [*record["prompt"].encode(), *record["completion"].encode(), 256]
        p = len(record["prompt"])
        expected.append((ids[:-1], [IGNORE_INDEX] * (p - 1) + ids[p:]))
    assert sorted(seen) == sorted(expected)  # every record exactly once, unchanged
    batch = next(iter(AutoDataProvider(AutoDataConfig(global_batch_size=4, microbatch_size=2), packed)))[0]
    assert batch["document_ids"].shape == (2, 64) and block_causal_mask(batch["document_ids"]).shape == (
        2,
        1,
        64,
        64,
    )


def test_pack_lengths_fills_rows_best_fit():
    lengths = [5, 3, 7, 2, 8, 1, 4]
    rows = pack_lengths(lengths, 10)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in row) <= 10 for row in rows)
    assert len(rows) == 3  # 30 tokens: the minimum
    assert pack_lengths([], 4) == []
    with pytest.raises(ValueError, match="every length must be in"):
        pack_lengths([5], 4)


def test_block_causal_mask_equals_attention_per_document():
    torch.manual_seed(0)
    lengths, heads, dim = [5, 1, 9, 3], 2, 8
    seq = sum(lengths) + 2  # two padding tokens at the end
    q, k, v = (torch.randn(1, heads, seq, dim, dtype=torch.float32) for _ in range(3))
    document_ids = torch.tensor(
        [d for d, n in enumerate(lengths) for _ in range(n)] + [PADDING_DOCUMENT_ID] * 2
    ).unsqueeze(0)
    mask = block_causal_mask(document_ids)
    assert mask.dtype == torch.bool and mask.shape == (1, 1, seq, seq)
    packed = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    start = 0
    for n in [*lengths, 2]:
        part = slice(start, start + n)
        alone = F.scaled_dot_product_attention(q[:, :, part], k[:, :, part], v[:, :, part], is_causal=True)
        torch.testing.assert_close(packed[:, :, part], alone, rtol=0, atol=1e-6)
        start += n
    assert torch.equal(block_causal_mask(document_ids[0]), mask)


def test_document_masking_on_pretraining_text(tmp_path):
    (tmp_path / "a.txt").write_text("abc", encoding="utf-8")
    (tmp_path / "b.txt").write_text("de", encoding="utf-8")
    (tmp_path / "c.txt").write_text("fghij", encoding="utf-8")
    dataset = TextDataset(tmp_path, seq_len=6, document_masking=True)  # a b c EOS d e | EOS f g h i j EOS
    first, second = dataset[0], dataset[1]
    assert first["input_ids"].tolist() == [97, 98, 99, 256, 100, 101]
    assert first["labels"].tolist() == [98, 99, 256, 100, 101, 256]
    assert first["document_ids"].tolist() == [0, 0, 0, 0, 1, 1]
    assert first["position_ids"].tolist() == [0, 1, 2, 3, 0, 1]
    assert second["document_ids"].tolist() == [0, 1, 1, 1, 1, 1]
    assert second["position_ids"].tolist() == [0, 0, 1, 2, 3, 4]
    assert "document_ids" not in TextDataset(tmp_path, seq_len=6)[0]
    assert eos_document_ids(np.array([7, 256, 256, 7]), 256).tolist() == [0, 0, 1, 2]

    write_token_file(tmp_path, tmp_path / "tokens.bin", progress=False)
    from_file = TokenFileDataset(tmp_path / "tokens.bin", seq_len=6, document_masking=True)
    assert from_file[1]["position_ids"].tolist() == second["position_ids"].tolist()

    class NoEos(ByteTokenizer):
        @property
        def eos_id(self):
            return None

    with pytest.raises(DatasetError, match="document_masking needs the end-of-document token"):
        TextDataset(tmp_path, seq_len=4, tokenizer=NoEos(), document_masking=True)


def test_the_trainers_task_ignores_the_label_d9d_data_pads_with():
    trainer = pytest.importorskip("d9d.trainer", reason="d9d-trainer is not installed")
    labels = torch.tensor([[5, IGNORE_INDEX, 7, IGNORE_INDEX]])
    assert int(trainer.CausalLMTask().batch_weight({"labels": labels})) == 2
    assert IGNORE_INDEX == -100  # torch's cross-entropy default
