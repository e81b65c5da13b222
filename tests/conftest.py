"""Shared fixtures: the embedded model is loaded once per test session (2-core CI)."""
import pytest


@pytest.fixture(scope="session")
def embedded_model():
    from models.load import load_model

    return load_model("default")
