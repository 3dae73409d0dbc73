import os
import warnings

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")
warnings.filterwarnings("ignore", module="modelopt")


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield
