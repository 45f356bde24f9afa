"""The Hugging Face backend's tests need its optional extra (`d9d-trainer[hf]`: transformers, and peft
for the adapter checks); without transformers installed they are not collected (e.g. in
.ci/torch_compat's environment, which installs the packages without that extra)."""

import importlib.util

collect_ignore_glob = [] if importlib.util.find_spec("transformers") is not None else ["test_*.py"]
