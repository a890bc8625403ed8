import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# KVBM_TEST_INSTALLED=1 tests the installed package (a wheel), not the source tree.
if not os.environ.get("KVBM_TEST_INSTALLED"):
    sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, os.path.join(ROOT, "tests"))

import pytest  # noqa: E402


@pytest.fixture
def s3_server(tmp_path_factory):
    """A real S3 server (versitygw over a temporary directory) on a free port,
    stopped at the end. Skipped where versitygw is not installed, except under
    CI (.ci/run installs it, so its absence there is a failure)."""
    from kvbm.testing.s3server import S3Server, binary

    if binary() is None:
        if os.environ.get("CI"):
            pytest.fail("versitygw not installed: .ci/s3-server.sh")
        pytest.skip("versitygw not installed: run .ci/s3-server.sh")
    srv = S3Server.create(str(tmp_path_factory.mktemp("s3")))
    yield srv
    srv.stop()
