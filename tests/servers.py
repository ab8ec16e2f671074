"""The real object-store servers the tests start (SeaweedFS for S3, fake-gcs-server for GCS,
Azurite for Azure blob).

They live in :mod:`tierstore_simulate.servers`, where ``tierstore simulate`` starts its own
object store with them; this module keeps the tests' and benchmarks' ``import servers``.
Importing it sets ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false`` before gcsfs loads."""

from tierstore_simulate.servers import (  # noqa: F401 - re-exported for the tests
    ACCESS_KEY, AZURE_ACCOUNT, AZURE_KEY, REGION, SECRET_KEY, Azurite, FakeGCS, SeaweedS3,
    find_azurite, find_fake_gcs_server, find_weed)
