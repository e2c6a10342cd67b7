"""Shared fixtures: an offline tiny model + task data, and one local Ray cluster per session."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def task_dir(tmp_path_factory):
    from hybridflow.data.tasks import make_addition_task

    out = tmp_path_factory.mktemp("task")
    make_addition_task(out)
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from hybridflow.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny", hidden_size=64, intermediate_size=128)


@pytest.fixture(scope="session")
def ray_cluster():
    from hybridflow.controller.worker_group import init_ray

    import ray

    init_ray(num_cpus=2)
    yield
    ray.shutdown()
