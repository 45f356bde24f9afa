"""`MixtureDataset`: the sampled share of each source follows its weight, sources repeat (or not)
as configured, and the mixture under `AutoDataProvider` resumes exactly on another data-parallel
degree and microbatch size."""

import itertools
import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from d9d.data import (
    AutoDataConfig,
    AutoDataProvider,
    DataPlacement,
    DatasetError,
    DataStateError,
    MixtureDataset,
    epoch_order,
)
from d9d.data.datasets.mixture import BLOCK, apportion


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


SIZES = {"web": 3000, "books": 20_000, "code": 500, "wiki": 800}


def _mixture(weights=None, sizes=None, **kwargs):
    weights = weights or {"web": 5.0, "books": 3.0, "code": 2.0}
    sizes = {**SIZES, **(sizes or {})}
    sources = [Tagged(sizes[name], list(SIZES).index(name)) for name in weights]
    return MixtureDataset(sources, list(weights.values()), names=list(weights), **kwargs)


def _steps(provider, n: int) -> list[list[tuple[int, int]]]:
    """(source, index) of every sample of the next `n` steps, per step."""
    steps = []
    for _ in range(n):
        ids = torch.cat([mb["input_ids"] for mb in next(provider)])
        steps.append([(int(s), int(i)) for s, i in ids[:, :2].tolist()])
    return steps


def test_the_sampled_token_share_of_each_source_is_its_weight_within_one_percent_over_1000_steps():
    mixture = _mixture()
    provider = AutoDataProvider(AutoDataConfig(global_batch_size=16, microbatch_size=2, seed=3), mixture)
    assert not provider.shuffle  # the mixture orders itself: one stream, each step the next 16 indices
    first = [provider.sample_indices(provider.epoch, provider.position)]
    assert [[s for s, _ in step] for step in _steps(provider, 2)] == [
        mixture.source_of(ix).tolist() for ix in (first[0], first[0] + 16)
    ]
    steps = mixture.source_of(np.arange(16 * 1000)).reshape(1000, 16)
    shares = np.bincount(steps.ravel(), minlength=3) / (16 * 1000)
    assert np.all(np.abs(shares - [0.5, 0.3, 0.2]) < 0.01), shares
    assert mixture.shares == pytest.approx([0.5, 0.3, 0.2], abs=1 / 1024)
    # interleaved evenly: every step holds each source within one sample of its share
    per_step = np.stack([np.bincount(step, minlength=3) for step in steps])
    assert np.all(np.abs(per_step - 16 * np.asarray(mixture.shares)) < 1 + 1e-9)


def _by_source(mixture, indices) -> dict[int, list[int]]:
    sources, local = mixture.locate_many(np.asarray(indices))
    return {s: local[sources == s].tolist() for s in range(len(mixture.sources))}


def _seen(steps, tag: int) -> list[int]:
    """The indices source `tag` gave, in order, over `steps` of (tag, index) samples."""
    return [i for step in steps for s, i in step if s == tag]


def test_each_source_is_read_in_passes_each_in_a_new_order():
    mixture = _mixture()
    assert len(mixture) == 3000 + 20_000 + 500  # a provider epoch: as many samples as the sources hold
    indices = np.arange(3 * len(mixture))  # stream indices run on past len
    sources, local = mixture.locate_many(indices)
    assert all(mixture.locate(i) == (sources[i], local[i]) for i in range(0, len(indices), 997))  # one = many
    assert np.array_equal(mixture.source_of(indices), sources)
    seen = _by_source(mixture, indices)
    for source, n in enumerate((3000, 20_000, 500)):
        passes = [seen[source][i : i + n] for i in range(0, len(seen[source]) - n + 1, n)]
        assert passes and all(sorted(p) == list(range(n)) for p in passes), source  # whole passes
        assert all(a != b for a, b in itertools.pairwise(passes)), source  # each pass reshuffled


def test_stop_ends_the_stream_at_the_first_index_where_a_source_would_repeat():
    mixture = _mixture(exhausted="stop")
    end = mixture.stream_end
    seen = _by_source(mixture, np.arange(end))
    assert all(len(v) == len(set(v)) for v in seen.values())  # no sample twice
    assert len(seen[2]) == 500  # code, the smallest at its weight, is used up exactly at the end
    with pytest.raises(IndexError, match="past the end of the mixture"):
        mixture[end]
    config = AutoDataConfig(global_batch_size=16, microbatch_size=8)
    provider = AutoDataProvider(config, mixture)
    assert provider.steps_left == end // 16
    taken = [next(provider) for _ in range(end // 16)]
    assert len(taken) == end // 16 and provider.steps_left == 0
    with pytest.raises(StopIteration):
        next(provider)
    with pytest.raises(DatasetError, match="before a step of 16 samples"):
        AutoDataProvider(config, MixtureDataset([Tagged(4, 0), Tagged(5000, 1)], [1, 1], exhausted="stop"))


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


def test_changed_weights_on_resume_continue_every_source_where_it_was_at_its_new_share():
    config = AutoDataConfig(global_batch_size=16, microbatch_size=2, seed=1)
    first = AutoDataProvider(config, _mixture())
    done = _steps(first, 7)  # 112 samples: the resume falls inside a block
    state = first.state_dict()
    changed = {"web": 1.0, "books": 1.0, "code": 2.0}
    other = AutoDataConfig(global_batch_size=16, microbatch_size=4, seed=1)  # and on 2 ranks
    ranks = [
        AutoDataProvider(other, _mixture(changed), context=DataPlacement(dp_rank=r, dp_size=2))
        for r in (0, 1)
    ]
    for rank in ranks:
        rank.load_state_dict(state)
    assert ranks[0].resume_changes == [
        "web: 0.5000 -> 0.2500",
        "books: 0.2998 -> 0.2500",
        "code: 0.2002 -> 0.5000",
    ]
    rest = [a + b for a, b in zip(*(_steps(rank, 30) for rank in ranks), strict=True)]
    for tag, name in enumerate(("web", "books", "code")):  # each source goes on in its pass order
        together = _seen(done, tag) + _seen(rest, tag)
        assert together == epoch_order(SIZES[name], seed=0, epoch=0)[: len(together)].tolist(), name
    per_step = np.stack([np.bincount([s for s, _ in step], minlength=3) for step in rest])
    assert np.all(np.abs(per_step - [4, 4, 8]) < 1 + 1e-9)  # the new shares from the first step on
    # a checkpoint of the changed run resumes it exactly (the new segment and its phase are kept)
    second = AutoDataProvider(config, _mixture(changed))
    second.load_state_dict(state)
    part = _steps(second, 11)
    third = AutoDataProvider(config, _mixture(changed))
    third.load_state_dict(second.state_dict())
    assert third.resume_changes == []
    assert part + _steps(third, 19) == rest


def test_a_source_added_on_resume_starts_at_its_first_sample_and_one_removed_is_dropped():
    config = AutoDataConfig(global_batch_size=16, microbatch_size=4)
    first = AutoDataProvider(config, _mixture())
    done = _steps(first, 5)
    resumed = AutoDataProvider(config, _mixture({"web": 1.0, "wiki": 1.0}))
    resumed.load_state_dict(first.state_dict())
    assert resumed.resume_changes == [
        "books: 0.2998 -> 0.0000",  # web keeps its share: not listed
        "code: 0.2002 -> 0.0000",
        "wiki: 0.0000 -> 0.5000",
    ]
    rest = _steps(resumed, 5)
    web = _seen(done, 0) + _seen(rest, 0)
    assert web == epoch_order(3000, seed=0, epoch=0)[: len(web)].tolist()
    assert _seen(rest, 3) == epoch_order(800, seed=0, epoch=0)[:40].tolist()
    assert not _seen(rest, 1) and not _seen(rest, 2)
    assert resumed.source_tokens()["web"] == 4 * len(web)  # the counts go on by name


def test_a_source_of_another_length_or_another_kind_of_dataset_is_refused_on_resume():
    config = AutoDataConfig(global_batch_size=16, microbatch_size=4)
    first = AutoDataProvider(config, _mixture())
    _steps(first, 2)
    resized = AutoDataProvider(config, _mixture(sizes={"web": 2999}))
    with pytest.raises(DataStateError, match=r"mixture source web \(saved 3000, now 2999\) samples"):
        resized.load_state_dict(first.state_dict())
    plain = AutoDataProvider(config, Tagged(64, 0))
    with pytest.raises(DataStateError, match="is a mixture's stream, but this dataset is not a mixture"):
        plain.load_state_dict(first.state_dict())
    with pytest.raises(DataStateError, match="is not a mixture's stream, but this dataset is a mixture"):
        first.load_state_dict(plain.state_dict())


def _weight_sets(seed: int, cases: int):
    """(weights, total) cases from a seeded generator: spread, many orders of magnitude apart,
    small integers (many equal remainders) and all equal; totals of one block or any up to 5000."""
    rng = np.random.default_rng(seed)
    for case in range(cases):
        n = int(rng.integers(1, 13))
        weights = [
            rng.uniform(0.01, 1.0, n),
            10.0 ** rng.uniform(-4, 4, n),
            rng.integers(1, 6, n).astype(float),
            np.full(n, rng.uniform(0.1, 10.0)),
        ][case % 4].tolist()
        yield weights, BLOCK if case % 3 == 0 else int(rng.integers(0, 5000))


def test_apportioned_counts_sum_to_the_total_each_within_one_of_its_share_largest_remainders_first():
    for weights, total in _weight_sets(seed=40, cases=2000):
        counts = apportion(weights, total)
        norm = sum(Fraction(w) for w in weights)
        exact = [Fraction(w) / norm * total for w in weights]  # the share in exact arithmetic
        assert sum(counts) == total, (weights, total, counts)
        assert all(math.floor(x) <= c <= math.ceil(x) for c, x in zip(counts, exact, strict=True)), (
            weights,
            total,
            counts,
        )
        # the slots left after the floors go to the largest remainders
        raised = [x - math.floor(x) for c, x in zip(counts, exact, strict=True) if c > math.floor(x)]
        kept = [x - math.floor(x) for c, x in zip(counts, exact, strict=True) if c == math.floor(x)]
        assert not raised or not kept or min(raised) >= max(kept) - 1e-9, (weights, total, counts)


def test_equal_weights_split_evenly_and_the_extra_slots_go_to_the_earliest_sources():
    for n in range(1, 13):
        for total in (0, 1, n - 1, n, n + 1, 1000, BLOCK, 4097):
            for weight in (1.0, 0.1, 7.3):
                expected = [total // n + (i < total % n) for i in range(n)]
                assert apportion([weight] * n, total) == expected, (n, total, weight)
    assert sum(apportion([1.0] * 6, BLOCK)) == BLOCK  # six equal sources over one block


@pytest.mark.parametrize(
    "weights", [[1.0] * 6, [5.0, 3.0, 2.0], [1.0, 0.002, 0.5, 0.25], [0.37, 0.21, 0.9, 0.05, 0.11]]
)
def test_each_block_of_a_mixture_holds_the_apportioned_slots_and_every_prefix_stays_within_one(weights):
    mixture = MixtureDataset([Tagged(50, i) for i in range(len(weights))], weights)
    counts = np.asarray(apportion(weights, BLOCK))
    assert mixture.shares == (counts / BLOCK).tolist()
    for block in range(3):
        sources = mixture.source_of(np.arange(block * BLOCK, (block + 1) * BLOCK))
        assert np.bincount(sources, minlength=len(weights)).tolist() == counts.tolist()
        taken = np.cumsum(np.eye(len(weights), dtype=np.int64)[sources], axis=0)  # per prefix, per source
        share = np.arange(1, BLOCK + 1)[:, None] * counts[None, :] / BLOCK
        assert np.all(np.abs(taken - share) < 1), weights
