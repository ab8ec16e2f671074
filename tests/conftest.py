"""Shared fixtures: tier roots in pytest's tmp_path and a helper to open a store on them."""

from __future__ import annotations

import compileall
import os
import warnings
from pathlib import Path

import pytest
import torch.distributed as dist

import tierstore
from tierstore_simulate.run import byte_compile

# The shared helpers' and the conformance kit's asserts explain themselves when they fail.
pytest.register_assert_rewrite("helpers", "scripts.worker_common", "tierstore_conformance")

# DCP warns on every single-process save/load; the tests do that on purpose.
warnings.filterwarnings("ignore", message="torch.distributed is disabled")
os.environ.setdefault("OMP_NUM_THREADS", "1")


#: Tests that take 10 s or more on the 2-core CI machine, longest first (from `make test`'s
#: --durations of 2026-11-30, agents and ranks started from the prewarmed interpreter). They
#: are scheduled first, half at the head of each xdist worker's share, so that no long test
#: starts last and keeps one worker busy after the other ran out of work.
LONGEST_FIRST = (
    "tests/test_fault_matrix.py::",  # its tests share the sample (a module fixture)
    "tests/test_simulate.py::test_simulate_runs_both_contenders_through_every_failure",
    "tests/test_reshard.py::test_a_2x2_checkpoint_restores_bitwise_at_other_shapes",
    "tests/test_hostile_checkpoints.py::test_every_bit_of_a_manifest_and_a_data_file_flipped",
    "tests/test_node_local_safety.py::",  # six of its tests share one launch (a module fixture)
    "tests/test_simulate.py::test_repeated_rounds_interleave_the_contenders",
    "tests/test_hangs.py::test_a_lost_rank_is_named_instead_of_waited_for[latest-hung]",
    "tests/test_erasure.py::test_two_lost_nodes_of_a_set_are_named_or_read_from_a_shared_tier",
    "tests/test_dedup_multirank.py::test_adapter_training_saves_only_what_changed",
    "tests/test_restart_path.py::test_a_restart_makes_one_s3_client",
    "tests/test_restart_requests.py::test_a_restart_asks_the_object_store_the_same_few_things",
    "tests/test_multirank.py::test_two_ranks_save_and_load_bitwise",
    "tests/test_peer.py::test_a_lost_node_comes_back_from_its_peers[clique]",
    "tests/test_node_local.py::test_node_local_ram_tier_with_a_shared_tier_behind_it",
    "tests/test_bench_charts.py::test_chart_from_real_json[save_load]",
    "tests/test_lightning.py::test_a_trainer_killed_mid_run_resumes_from_the_newest_checkpoint",
    "tests/test_example_plugin.py::test_the_example_passes_its_conformance_tests",
    "tests/test_torchtitan.py::test_a_rank_killed_mid_run_resumes_bitwise_and_trains_as",
)


def pytest_sessionstart(session):
    """Write the bytecode of the project's packages and of the tests' scripts once, before any
    test (in the controller, before xdist starts its workers). The suite starts some 650
    processes that import tierstore; with ``PYTHONDONTWRITEBYTECODE`` set (as on CI machines)
    each would compile every module it imports from source."""
    if hasattr(session.config, "workerinput"):
        return
    byte_compile(("tierstore", "tierstore_plugins", "tierstore_simulate",
                  "tierstore_conformance"))
    compileall.compile_dir(str(Path(__file__).parent), quiet=2)


def pytest_collection_modifyitems(config, items):
    """Run the longest tests first, alternately at the head of each half of the collection
    (pytest-xdist's worksteal gives each worker a contiguous share to start with, and steals
    from the tail). The tests one prefix matches stay together (a module's tests sharing a
    module-scoped fixture run it once)."""
    groups: list[list] = [[] for _ in LONGEST_FIRST]
    rest = []
    for item in items:
        i = next((i for i, prefix in enumerate(LONGEST_FIRST)
                  if item.nodeid.startswith(prefix)), None)
        (rest if i is None else groups[i]).append(item)
    first = [it for g in groups[::2] for it in g]
    second = [it for g in groups[1::2] for it in g]
    half = max(0, len(items) // 2 - len(first))
    items[:] = first + rest[:half] + second + rest[half:]


@pytest.fixture
def local_config(tmp_path):
    """A one-tier config (`local` backend) rooted in a fresh directory."""
    return {"tier": [{"name": "nvme", "backend": "local", "path": str(tmp_path / "nvme")}]}


@pytest.fixture
def one_rank_group():
    """torch.distributed with one gloo rank in this process (for DTensor / ShardedTensor);
    torn down afterwards so that the other tests run without it."""
    assert not dist.is_initialized(), "an earlier test left a process group in this process"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def store(local_config):
    """An open store with one `local` tier; closed after the test."""
    with tierstore.open(local_config) as s:
        yield s


# --- Real object-store servers (tests/servers.py) ---------------------------------------
# `seaweed` (SeaweedFS S3), `fake_gcs` (fake-gcs-server) and `azurite` (Azurite, Azure blob)
# start once per session, on demand, and are SIGKILLed at the end. `s3_bucket` / `gcs_bucket`
# / `az_container` give each test a fresh bucket URL; reach the server with e.g.
# `seaweed.storage_options()` / `seaweed.filesystem()` (Azurite: `azurite.get_blob()`).
# Importing servers also sets GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false before gcsfs loads.
import re as _re
import uuid as _uuid

from servers import Azurite, FakeGCS, SeaweedS3


def _bucket_name(request) -> str:
    """A unique, valid S3/GCS bucket name that mentions the test: `t-<test>-<hex>`."""
    stem = _re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")[:40].strip("-")
    return f"t-{stem}-{_uuid.uuid4().hex[:10]}" if stem else f"t-{_uuid.uuid4().hex[:16]}"


def _fresh_bucket(server, request):
    """A new bucket on ``server`` (restarted if a previous test killed it and did not bring it
    back) for the test; deleted with its objects afterwards."""
    if not server.running():
        server.restart()
    url = server.make_bucket(_bucket_name(request))
    yield url
    _drop_bucket(server, url)


def _drop_bucket(server, url: str) -> None:
    """Best effort: delete a test's bucket and its objects if the server is up."""
    if not server.running():
        return
    try:
        server.filesystem().rm(url.split("://", 1)[1], recursive=True)
    except Exception as e:  # noqa: BLE001 - cleanup only; the test's result stands
        warnings.warn(f"could not delete test bucket {url}: {e!r}", stacklevel=1)


@pytest.fixture(scope="session")
def seaweed():
    """A running SeaweedFS S3 server (SeaweedS3): credentials enforced, data in a temp dir."""
    with SeaweedS3() as server:
        yield server


@pytest.fixture(scope="session")
def fake_gcs():
    """A running fake-gcs-server (FakeGCS), filesystem backend in a temp dir."""
    with FakeGCS() as server:
        yield server


@pytest.fixture
def s3_bucket(seaweed, request):
    """`s3://<fresh bucket>` on the session's SeaweedFS; storage options: `seaweed.storage_options()`."""
    # Each SeaweedFS bucket takes 7 of the server's volume slots (a few hundred, by free disk).
    yield from _fresh_bucket(seaweed, request)


@pytest.fixture
def gcs_bucket(fake_gcs, request):
    """`gs://<fresh bucket>` on the session's fake-gcs-server; options: `fake_gcs.storage_options()`."""
    yield from _fresh_bucket(fake_gcs, request)


@pytest.fixture(scope="session")
def azurite():
    """A running Azurite blob service (Azurite): one account, its key enforced, data in a temp
    dir. Skipped, saying why, where Azurite is not installed (`make test` installs it)."""
    try:
        server = Azurite()
    except FileNotFoundError as e:
        pytest.skip(f"Azurite is not available: {e}")
    with server:
        yield server


@pytest.fixture
def az_container(azurite, request):
    """`az://<fresh container>` on the session's Azurite; options: `azurite.storage_options()`."""
    if not azurite.running():
        azurite.restart()
    name = _bucket_name(request)
    url = azurite.make_container(name)
    yield url
    if azurite.running():
        try:
            azurite.drop_container(name)
        except Exception as e:  # noqa: BLE001 - cleanup only; the test's result stands
            warnings.warn(f"could not delete test container {url}: {e!r}", stacklevel=1)
