"""The model provider's import source: found by its declared ability, asked once."""

from pathlib import Path
from types import SimpleNamespace

from torch import nn

from d9d.trainer.build.starting_weights import StartingWeights
from d9d.trainer.providers import ImportsModelWeights, PrepareImportModelStageResult


class _Exports:
    def prepare_export_model_stage(self, context):
        raise AssertionError("not asked here")


class _Imports(_Exports):
    def __init__(self, folder):
        self.folder = folder
        self.asked = 0

    def prepare_import_model_stage(self, context):
        self.asked += 1
        return PrepareImportModelStageResult(folder=self.folder)


class _ImportsNothing(_Exports):
    prepare_import_model_stage = None  # a method set to None is not there


def _starting(provider):
    job = SimpleNamespace(model_provider=provider, loaded=SimpleNamespace(base_dir=Path()))
    return StartingWeights(job, context=None, model=nn.Linear(2, 2))


def test_a_provider_without_prepare_import_model_stage_has_no_import_source():
    for provider in (_Exports(), _ImportsNothing()):
        assert not isinstance(provider, ImportsModelWeights)
        assert _starting(provider).source() is None


def test_the_import_source_is_asked_once():
    for folder in ("hf", None):
        provider = _Imports(folder)
        assert isinstance(provider, ImportsModelWeights)
        starting = _starting(provider)
        sources = [starting.source(), starting.source()]
        assert [s.folder if s is not None else None for s in sources] == [folder, folder]
        assert provider.asked == 1
