"""`MixtureDataset`: the sampled share of each source follows its weight, sources repeat (or not)
as configured, and the mixture under `AutoDataProvider` resumes exactly on another data-parallel
degree and microbatch size."""

import numpy as np
import pytest
import torch

from d9d.data import (
    AutoDataConfig,
    AutoDataProvider,
    DataPlacement,
    DatasetError,
    MixtureDataset,
    advance_position,
)


class Tagged:
    """`n` samples of seq_len 4 that say which source and index they are."""

    def __init__(self, n: int, source: int, seq_len: int = 4) -> None:
        self.n, self.source, self.seq_len = n, source, seq_len

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < self.n:
            raise IndexError(i)
        return {"input_ids": torch.tensor([self.source, i, 0, 0]), "labels": torch.zeros(4, dtype=torch.long)}


def _mixture(**kwargs):
    sources = [Tagged(3000, 0), Tagged(20_000, 1), Tagged(500, 2)]
    return MixtureDataset(sources, [5.0, 3.0, 2.0], names=["web", "books", "code"], **kwargs)


def _steps(provider, n: int) -> list[list[tuple[int, int]]]:
    """(source, index) of every sample of the next `n` steps, per step."""
    steps = []
    for _ in range(n):
        ids = torch.cat([mb["input_ids"] for mb in next(provider)])
        steps.append([(int(s), int(i)) for s, i in ids[:, :2].tolist()])
    return steps


def test_the_sampled_token_share_of_each_source_is_its_weight_within_one_percent_over_1000_steps():
    mixture = _mixture()
    config = AutoDataConfig(global_batch_size=16, microbatch_size=2, seed=3)
    provider = AutoDataProvider(config, mixture)
    # the indices the provider loads for each of 1000 steps of the quickstart's batch (16 samples of
    # one length: the token share is the sample share); the first two steps checked against loading
    epoch, position, loaded = 0, 0, []
    for _ in range(1000):
        loaded.append(provider.sample_indices(epoch, position))
        epoch, position = advance_position(epoch, position, num_samples=len(mixture), global_batch_size=16,
                                           drop_last=True)  # fmt: skip
    assert [[s for s, _ in step] for step in _steps(provider, 2)] == [
        mixture.source_of(ix).tolist() for ix in loaded[:2]
    ]
    shares = np.bincount(mixture.source_of(np.concatenate(loaded)), minlength=3) / (16 * 1000)
    assert np.all(np.abs(shares - [0.5, 0.3, 0.2]) < 0.01), shares
    assert mixture.shares == pytest.approx([0.5, 0.3, 0.2], abs=1 / 1024)


def test_repeat_sees_the_largest_source_whole_and_repeats_the_others_in_new_orders():
    mixture = _mixture()
    sources, local = mixture.locate_many(np.arange(len(mixture)))
    samples = list(zip(sources.tolist(), local.tolist(), strict=True))
    assert all(mixture.locate(i) == samples[i] for i in range(0, len(mixture), 997))  # one = many
    books = [i for s, i in samples if s == 1]
    assert sorted(set(books)) == list(range(20_000))  # the source that needs most blocks is seen whole
    code = [i for s, i in samples if s == 2]
    first, second = code[:500], code[500:1000]
    assert sorted(first) == sorted(second) == list(range(500)) and first != second  # each pass reshuffled
    assert np.array_equal(mixture.source_of(np.arange(len(mixture))), [s for s, _ in samples])


def test_stop_ends_the_mixture_before_any_source_repeats():
    mixture = _mixture(exhausted="stop")
    samples = list(zip(*(a.tolist() for a in mixture.locate_many(np.arange(len(mixture)))), strict=True))
    for source in range(3):
        seen = [i for s, i in samples if s == source]
        assert len(seen) == len(set(seen)), source  # no sample twice
    # the smallest source at its weight sets the length: 500 code samples at ~20% of each block
    assert len(mixture) == (500 // mixture._counts[2]) * 1024


def test_a_mixture_resumes_exactly_on_another_data_parallel_degree_and_microbatch_size():
    config = AutoDataConfig(global_batch_size=16, microbatch_size=2, seed=1)
    straight = AutoDataProvider(config, _mixture())
    expected = _steps(straight, 12)
    first = AutoDataProvider(config, _mixture())
    done = _steps(first, 5)
    state = first.state_dict()
    # resume on 2 data-parallel ranks with microbatches of 4: each step is the two ranks' halves
    other = AutoDataConfig(global_batch_size=16, microbatch_size=4, seed=1)
    ranks = [AutoDataProvider(other, _mixture(), context=DataPlacement(dp_rank=r, dp_size=2)) for r in (0, 1)]
    for rank in ranks:
        rank.load_state_dict(state)
    rest = [a + b for a, b in zip(*(_steps(rank, 7) for rank in ranks), strict=True)]
    assert done + rest == expected


@pytest.mark.parametrize(
    ("weights", "sizes", "kwargs", "message"),
    [
        ([1.0, 0.0], [10, 10], {}, "weight of mixture source 1 must be a finite number > 0"),
        ([1.0, -2], [10, 10], {}, "weight of mixture source 1 must be a finite number > 0"),
        ([1.0, float("nan")], [10, 10], {}, "weight of mixture source 1 must be a finite number > 0"),
        ([1.0, float("inf")], [10, 10], {}, "weight of mixture source 1 must be a finite number > 0"),
        ([1.0, 1.0], [10, 10], {"names": ["a"]}, "a mixture of 2 sources got 1 names"),
        ([1.0, 1.0], [10, 10], {"names": ["a", "a"]}, "a is given twice"),
        ([1.0, 1e-5], [10, 10], {}, "less than one sample in a block of 1024"),
        ([1.0, 1.0], [10, 0], {}, "mixture source 1 holds no samples"),
        ([1.0], [10, 10], {}, "a mixture of 2 sources got 1 weights"),
        ([1.0, 1.0], [10, 5000], {"exhausted": "stop"}, "source 0 has fewer samples than its share"),
    ],
)
def test_bad_mixtures_are_refused_in_one_line(weights, sizes, kwargs, message):
    with pytest.raises(DatasetError, match=message):
        MixtureDataset([Tagged(n, i) for i, n in enumerate(sizes)], weights, **kwargs)


def test_sources_of_other_lengths_are_refused():
    with pytest.raises(DatasetError, match=r"different seq_len \(\[4, 8\]\)"):
        MixtureDataset([Tagged(10, 0), Tagged(10, 1, seq_len=8)], [1, 1])


def test_the_provider_counts_each_sources_tokens_and_keeps_the_count_across_a_resume_on_another_mesh():
    config = AutoDataConfig(global_batch_size=16, microbatch_size=2, seed=2)
    straight = AutoDataProvider(config, _mixture())
    loaded = []
    for _ in range(9):
        epoch, position = straight.epoch, straight.position
        loaded.append(straight.sample_indices(epoch, position))
        next(straight)
    expected = np.bincount(_mixture().source_of(np.concatenate(loaded)), minlength=3) * 4  # seq_len 4
    assert straight.source_tokens() == dict(zip(["web", "books", "code"], expected.tolist(), strict=True))
    first = AutoDataProvider(config, _mixture())
    for _ in range(4):
        next(first)
    state = first.state_dict()
    resumed = AutoDataProvider(config, _mixture(), context=DataPlacement(dp_rank=1, dp_size=2))
    resumed.load_state_dict(state)
    for _ in range(5):
        next(resumed)
    assert resumed.source_tokens() == straight.source_tokens()
    assert sum(straight.source_tokens().values()) == 9 * 16 * 4
    assert AutoDataProvider(config, Tagged(64, 0)).source_tokens() is None  # not a mixture


def test_sources_tokenized_differently_are_refused():
    small, large = Tagged(10, 0), Tagged(10, 1)
    small.vocab_size, large.vocab_size = 257, 8000
    with pytest.raises(DatasetError, match=r"different vocabularies \(vocab_size: 0: 257, 1: 8000\)"):
        MixtureDataset([small, large], [1, 1])
    masked, plain = Tagged(10, 0), Tagged(10, 1)
    masked.document_masking, plain.document_masking = True, False
    with pytest.raises(DatasetError, match="with and without document masking"):
        MixtureDataset([masked, plain], [1, 1])
