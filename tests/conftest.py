"""Shared fixtures: stores on local disk, memory:// and a real S3 endpoint (moto server)."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("default", max_examples=25, deadline=None)
settings.register_profile(
    "ci",
    max_examples=25,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("nightly", max_examples=500, deadline=None)
settings.load_profile(
    os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "default")
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[dict[str, Any]]:
    """A real S3 endpoint on 127.0.0.1 (moto's server mode) with one bucket."""
    from moto.server import ThreadedMotoServer

    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    import boto3

    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(
        Bucket="cocoon"
    )
    opts = {"endpoint_url": endpoint, "key": "testing", "secret": "testing"}
    yield {"bucket": "cocoon", "storage_options": opts}
    server.stop()


@pytest.fixture(params=["local", "memory", "s3"])
def store_location(request: pytest.FixtureRequest, tmp_path: Any) -> dict[str, Any]:
    """`{"url": ..., "storage_options": ...}` of a fresh, empty store location."""
    if request.param == "local":
        return {"url": str(tmp_path / "store.zarr"), "storage_options": None}
    if request.param == "memory":
        return {"url": f"memory://cocoon-{uuid.uuid4().hex}", "storage_options": None}
    s3 = request.getfixturevalue("s3_endpoint")
    return {
        "url": f"s3://{s3['bucket']}/{uuid.uuid4().hex}.zarr",
        "storage_options": s3["storage_options"],
    }
