import os
import warnings

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")
warnings.filterwarnings("ignore", module="modelopt")

from interpreter_speedup import install as _skip_nested_repatching  # noqa: E402  (after TRITON_INTERPRET is set)

_skip_nested_repatching()


def pytest_collection_modifyitems(items):
    """The `heavy` tests first (a stable sort): pytest-xdist deals the first tests to its workers in turns, so the
    two workers share the long ones and the suite ends on short tests instead of one worker finishing a long test
    while the other waits."""
    items.sort(key=lambda item: item.get_closest_marker("heavy") is None)


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield
