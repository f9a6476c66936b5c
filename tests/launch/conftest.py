"""A local Ray cluster (2 CPUs, small object store) shared by the launch tests, always shut down."""

import os

import pytest


@pytest.fixture(scope="session")
def ray_cluster():
    ray = pytest.importorskip("ray")
    os.environ.setdefault("RAY_DISABLE_IMPORT_WARNING", "1")
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=96 << 20, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}})
    yield ray
    ray.shutdown()
