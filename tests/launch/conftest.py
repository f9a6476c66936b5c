"""A local Ray cluster (2 CPUs, small object store) shared by the launch tests, always shut down.

Package-scoped: it is gone before the tests after `tests/launch` run (its daemons take a tenth of
the box's two cores while up)."""

import os

import pytest


@pytest.fixture(scope="package")
def ray_cluster():
    ray = pytest.importorskip("ray")
    os.environ.setdefault("RAY_DISABLE_IMPORT_WARNING", "1")
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=96 << 20, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}})
    yield ray
    ray.shutdown()
