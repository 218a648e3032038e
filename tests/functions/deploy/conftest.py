import pytest

from tests.functions.deploy.kube_server import KubeServer


@pytest.fixture
def kube():
    with KubeServer() as server:
        yield server
