"""The framework layouts built on a DCP directory (Lightning's sharded checkpoint, torchtitan's
``step-N/``) under URLs: recognised as locally, not read as plain DCP (issue 28).

Over loopback HTTP (which cannot list: the framework's own files are asked for by name, the
data files are those ``.metadata`` names) and in an S3-compatible bucket (which lists): ``show
--json`` of the URL equals the local one's apart from the paths, and ``verify`` and ``diff``
agree with the local directory.
"""

from __future__ import annotations

import pytest

from tests import test_remote as shared
from tests.support.helpers import FIXTURES
from tests.support.range_server import RangeServer
from tests.test_remote import _serve_directory, _upload_tree, run, show_json

# tests/test_remote.py's fixtures, registered here too (as tests/test_remote_deepspeed.py does)
bucket, s3_endpoint, server = shared.bucket, shared.s3_endpoint, shared.server
quick_retries = shared.quick_retries

FRAMEWORKS = FIXTURES / "frameworks"
CASES = {
    "lightning_sharded": "lightning_sharded/checkpoints/epoch=2-step=4",
    "torchtitan": "torchtitan/checkpoint/step-3",
}


@pytest.mark.parametrize("layout", sorted(CASES))
def test_over_http_as_locally(server: RangeServer, layout: str) -> None:
    local = FRAMEWORKS / CASES[layout]
    url = _serve_directory(server, local, f"run/{local.name}")
    shown = show_json(url)
    assert shown["layout"] == layout
    assert shown == show_json(local)
    verified = run("verify", url)
    assert verified.exit_code == 0, verified.output
    assert run("diff", url, local).exit_code == 0


def test_over_http_a_dcp_directory_without_meta_pt_stays_dcp(server: RangeServer) -> None:
    local = FRAMEWORKS / CASES["lightning_sharded"]
    url = _serve_directory(server, local, "plain")
    del server.files["/plain/meta.pt"]
    shown = show_json(url)
    assert (shown["format"], shown["layout"]) == ("dcp", "training_checkpoint")


@pytest.mark.parametrize("layout", sorted(CASES))
def test_in_a_bucket_as_locally(bucket: str, layout: str) -> None:
    local = FRAMEWORKS / CASES[layout]
    url = _upload_tree(local, f"dirs/{local.name}")
    shown = show_json(url)
    assert shown["layout"] == layout
    assert shown == show_json(local)
    assert run("diff", url, local).exit_code == 0
