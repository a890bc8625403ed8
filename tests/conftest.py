import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# KVBM_TEST_INSTALLED=1 tests the installed package (a wheel), not the source tree.
if not os.environ.get("KVBM_TEST_INSTALLED"):
    sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, os.path.join(ROOT, "tests"))
