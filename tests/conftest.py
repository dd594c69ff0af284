import pytest

from fleetutil import run_cli


@pytest.fixture
def cli():
    return run_cli
