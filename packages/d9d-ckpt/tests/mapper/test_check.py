"""Checks of a mapper against a state: missing keys, unconsumed keys (error or warning)."""

import warnings

import pytest
import torch

from d9d.ckpt import MappingError, Parallel, Rename, UnusedKeysWarning, apply_mapper, check_mapper


def test_missing_inputs_are_listed():
    mapper = Parallel([Rename("a", "x"), Rename("b", "y"), Rename("c", "z")])
    with pytest.raises(
        MappingError, match=r"2 keys that the mapper reads are missing from the state: \['b', 'c'\]"
    ):
        check_mapper(mapper, ["a"])


def test_unconsumed_inputs_are_an_error_by_default():
    with pytest.raises(
        MappingError, match=r"2 keys of my folder are consumed by no group.*\['p', 'q'\].*unused='warn'"
    ):
        check_mapper(Rename("a", "x"), ["a", "q", "p"], source="my folder")


def test_unconsumed_inputs_warn_or_pass_on_request():
    with pytest.warns(UnusedKeysWarning, match=r"\['q'\]"):
        check_mapper(Rename("a", "x"), ["a", "q"], unused="warn")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_mapper(Rename("a", "x"), ["a", "q"], unused="ignore")


def test_long_key_lists_are_cut_with_a_count():
    keys = [f"k{i:02d}" for i in range(20)]
    with pytest.raises(MappingError, match=r"'k11', \.\.\. \(\+8 more\)\]"):
        check_mapper(Rename("a", "x"), ["a", *keys])


def test_apply_mapper_checks_before_applying():
    with pytest.raises(MappingError, match="missing"):
        apply_mapper(Rename("a", "x"), {"b": torch.zeros(1)}, unused="ignore")
