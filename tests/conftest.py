"""Shared test helpers. Tests run on the real Vulkan device vkdsl picks (lavapipe in CI)."""
import numpy as np
import pytest


@pytest.fixture(scope="session")
def dev():
    from vkdsl.runtime import open_device
    return open_device()


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def nmse(y, ref):
    """Normalized mean squared error against a float64 reference."""
    y, ref = np.asarray(y, np.float64), np.asarray(ref, np.float64)
    return float(np.sum((y - ref) ** 2) / max(np.sum(ref ** 2), 1e-300))
