import os
import sys

import torch

# The test-support module `_pipeline_model` lives beside these tests (pytest's importlib mode does not
# put this folder on sys.path). One intra-op thread in the parent keeps the forked ranks fork-safe.
sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(1)
