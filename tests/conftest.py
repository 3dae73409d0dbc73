import os
import warnings

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")
warnings.filterwarnings("ignore", module="modelopt")

from interpreter_speedup import install as _speed_up_interpreter  # noqa: E402  (after TRITON_INTERPRET is set)

_speed_up_interpreter()


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield
